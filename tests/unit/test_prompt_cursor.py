"""The per-iteration prompt cursor: seeded epochs, the same prompts on every call, each epoch shuffled once."""

from __future__ import annotations

import random

import pytest

import tasks.data.prompts as prompts


def _reference(rows, *, iteration, per_iteration, seed):
    """The cursor's definition, shuffling the epoch afresh on every call."""
    out, position = [], (iteration - 1) * per_iteration
    while len(out) < per_iteration:
        epoch, offset = divmod(position, len(rows))
        order = list(range(len(rows)))
        random.Random(f"{seed}:{epoch}").shuffle(order)
        take = min(per_iteration - len(out), len(rows) - offset)
        out.extend(rows[i] for i in order[offset : offset + take])
        position += take
    return out


@pytest.mark.parametrize(("size", "per_iteration"), [(10, 4), (7, 7), (3, 8)])
def test_iterations_take_the_seeded_epochs_in_order(size, per_iteration):
    prompts.epoch_order.cache_clear()
    rows = [{"prompt_id": str(i)} for i in range(size)]
    for seed in (0, 5):
        for n in range(1, 12):
            got = prompts.iteration_prompts(rows, iteration=n, per_iteration=per_iteration, seed=seed)
            assert got == _reference(rows, iteration=n, per_iteration=per_iteration, seed=seed), (seed, n)


def test_each_epoch_is_shuffled_once_per_process(monkeypatch):
    prompts.epoch_order.cache_clear()
    shuffled = []
    original = random.Random.shuffle

    def counted(self, x):
        shuffled.append(len(x))
        return original(self, x)

    monkeypatch.setattr(random.Random, "shuffle", counted)
    rows = [{"prompt_id": str(i)} for i in range(1000)]
    for n in range(1, 21):  # 20 iterations of 100 prompts: epochs 0 and 1
        prompts.iteration_prompts(rows, iteration=n, per_iteration=100, seed=3)
    assert shuffled == [1000, 1000]
    order = prompts.epoch_order(1000, seed=3, epoch=0)
    with pytest.raises(ValueError, match="read-only"):
        order[0] = 1
