"""Chunked student log-probs equal the unchunked full-vocabulary log-softmax, values and gradients; the
streamed teacher entropy equals the full-softmax entropy, sharded or not."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from sdpo_core.chunked import (
    chunked_token_entropy,
    chunked_token_logprobs,
    reference_token_entropy,
    reference_token_logprobs,
)
from sdpo_core.divergence import topk_divergence

M, V, K = 13, 37, 5


@pytest.fixture
def problem():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(M, V, generator=gen, dtype=torch.float64) * 3
    rows = torch.tensor([0, 2, 3, 5, 6, 7, 9, 10, 12])
    ids = torch.randint(0, V, (rows.numel(), K), generator=gen)
    ids[:, -1] = V - 1  # an id in the last vocabulary chunk
    ids[0, 1] = ids[0, 0]  # a repeated id in one row (the sampled token is often in the top-K)
    upstream = torch.randn(rows.numel(), K, generator=gen, dtype=torch.float64)
    return logits, rows, ids, upstream


def value_and_grad(fn, logits, upstream):
    leaf = logits.clone().requires_grad_(True)
    out = fn(leaf)
    (out * upstream).sum().backward()
    return out.detach(), leaf.grad


def assert_rel_close(actual, expected, rel=1e-5):
    err = float((actual.double() - expected.double()).norm() / expected.double().norm())
    assert err <= rel, f"relative error {err:.3e} > {rel}"


@pytest.mark.parametrize("chunk_tokens,chunk_vocab", [(1, None), (4, None), (1024, None), (3, 8), (2, 1), (5, 36)])
def test_values_and_gradients_match_the_full_log_softmax(problem, chunk_tokens, chunk_vocab):
    logits, rows, ids, upstream = problem
    want, want_grad = value_and_grad(lambda z: reference_token_logprobs(z, rows, ids), logits, upstream)
    got, got_grad = value_and_grad(
        lambda z: chunked_token_logprobs(z, rows, ids, chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab),
        logits,
        upstream,
    )
    assert_rel_close(got, want)
    assert_rel_close(got_grad, want_grad)
    # positions that score nothing get an exactly zero gradient
    untouched = torch.ones(M, dtype=torch.bool)
    untouched[rows] = False
    assert got_grad[untouched].abs().max() == 0


def test_float32_matches_a_float64_oracle_within_1e_5(problem):
    logits, rows, ids, upstream = problem
    want, want_grad = value_and_grad(lambda z: reference_token_logprobs(z, rows, ids), logits, upstream)
    got, got_grad = value_and_grad(
        lambda z: chunked_token_logprobs(z, rows, ids, chunk_tokens=4, chunk_vocab=16), logits.float(), upstream.float()
    )
    assert got.dtype == torch.float32
    assert_rel_close(got, want)
    assert_rel_close(got_grad, want_grad)


def test_k_equal_to_v_gives_a_normalised_distribution_with_the_log_softmax_gradient():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, V, generator=gen, dtype=torch.float64)
    rows = torch.arange(6)
    ids = torch.arange(V).expand(6, V)
    upstream = torch.randn(6, V, generator=gen, dtype=torch.float64)
    got, got_grad = value_and_grad(
        lambda z: chunked_token_logprobs(z, rows, ids, chunk_tokens=4, chunk_vocab=10), logits, upstream
    )
    want, want_grad = value_and_grad(lambda z: torch.log_softmax(z, -1), logits, upstream)
    torch.testing.assert_close(got.exp().sum(-1), torch.ones(6, dtype=torch.float64))
    assert_rel_close(got, want)
    assert_rel_close(got_grad, want_grad)


def test_padded_vocabulary_columns_are_ignored_and_get_no_gradient(problem):
    logits, rows, ids, upstream = problem
    padded = torch.cat([logits, torch.zeros(M, 3, dtype=logits.dtype)], dim=1)  # Megatron's vocab padding
    got, got_grad = value_and_grad(
        lambda z: chunked_token_logprobs(z, rows, ids, vocab_size=V, chunk_tokens=4, chunk_vocab=7), padded, upstream
    )
    want, want_grad = value_and_grad(lambda z: reference_token_logprobs(z, rows, ids), logits, upstream)
    assert_rel_close(got, want)
    assert_rel_close(got_grad[:, :V], want_grad)
    assert got_grad[:, V:].abs().max() == 0


def test_bfloat16_logits_get_a_bfloat16_gradient_close_to_float32(problem):
    logits, rows, ids, upstream = problem
    low = logits.to(torch.bfloat16)
    got, got_grad = value_and_grad(
        lambda z: chunked_token_logprobs(z, rows, ids, chunk_tokens=4), low, upstream.float()
    )
    want, want_grad = value_and_grad(lambda z: reference_token_logprobs(z, rows, ids), low.double(), upstream)
    assert got.dtype == torch.float32 and got_grad.dtype == torch.bfloat16
    assert_rel_close(got, want, rel=1e-6)  # the same bf16 inputs, reduced in float32
    assert_rel_close(got_grad, want_grad, rel=1e-2)  # the gradient is rounded to bf16


def test_the_top_k_tail_loss_through_chunked_logprobs_has_the_reference_gradient(problem):
    logits, rows, ids, _ = problem
    ids = torch.stack([torch.randperm(V, generator=torch.Generator().manual_seed(i))[:K] for i in range(rows.numel())])
    teacher = torch.log_softmax(torch.randn(rows.numel(), V, dtype=torch.float64), -1).gather(-1, ids)

    def loss(fn):
        leaf = logits.clone().requires_grad_(True)
        value = topk_divergence(fn(leaf), teacher, alpha=0.5, tail=True).mean()
        value.backward()
        return value.detach(), leaf.grad

    want, want_grad = loss(lambda z: reference_token_logprobs(z, rows, ids))
    got, got_grad = loss(lambda z: chunked_token_logprobs(z, rows, ids, chunk_tokens=2, chunk_vocab=9))
    assert_rel_close(got, want)
    assert_rel_close(got_grad, want_grad)


class ThreadReducer:
    """All-reduce between threads that each hold one vocabulary shard (a stand-in for a process group)."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world)
        self.slots: dict[int, torch.Tensor] = {}

    def _reduce(self, rank: int, tensor: torch.Tensor, op) -> None:
        self.slots[rank] = tensor.clone()
        self.barrier.wait()
        combined = op(torch.stack([self.slots[r] for r in sorted(self.slots)]))
        self.barrier.wait()
        tensor.copy_(combined)

    def for_rank(self, rank: int):
        outer = self

        class Bound:
            def max_(self, tensor):
                outer._reduce(rank, tensor, lambda s: s.max(0).values)

            def sum_(self, tensor):
                outer._reduce(rank, tensor, lambda s: s.sum(0))

        return Bound()


@pytest.mark.parametrize("world", [2, 3])
def test_vocabulary_shards_with_a_reducer_equal_the_unsharded_result(problem, world):
    logits, rows, ids, upstream = problem
    shard = -(-V // world)
    padded = torch.cat([logits, torch.zeros(M, shard * world - V, dtype=logits.dtype)], dim=1)
    want, want_grad = value_and_grad(lambda z: reference_token_logprobs(z, rows, ids), logits, upstream)
    reducer = ThreadReducer(world)
    results: dict[int, tuple] = {}

    def run(rank: int) -> None:
        local = padded[:, rank * shard : (rank + 1) * shard]
        results[rank] = value_and_grad(
            lambda z: chunked_token_logprobs(
                z,
                rows,
                ids,
                vocab_size=V,
                vocab_start=rank * shard,
                chunk_tokens=4,
                chunk_vocab=5,
                reducer=reducer.for_rank(rank),
            ),
            local,
            upstream,
        )

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rank in range(world):
        assert_rel_close(results[rank][0], want)  # every rank gets the full log-probs
    grad = torch.cat([results[r][1] for r in range(world)], dim=1)
    assert_rel_close(grad[:, :V], want_grad)


def test_repeated_rows_and_out_of_range_ids_are_refused(problem):
    logits, rows, ids, _ = problem
    with pytest.raises(ValueError, match="distinct"):
        chunked_token_logprobs(logits, torch.tensor([1, 1]), ids[:2])
    bad = ids.clone()
    bad[0, 0] = V
    with pytest.raises(ValueError, match="outside"):
        chunked_token_logprobs(logits, rows, bad)
    with pytest.raises(ValueError, match="vocab_size"):
        chunked_token_logprobs(logits, rows, ids, vocab_start=5)


def test_no_rows_give_an_empty_result_and_a_zero_gradient(problem):
    logits, _, _, _ = problem
    leaf = logits.clone().requires_grad_(True)
    out = chunked_token_logprobs(leaf, torch.zeros(0, dtype=torch.long), torch.zeros(0, K, dtype=torch.long))
    assert out.shape == (0, K)
    out.sum().backward()
    assert leaf.grad.abs().max() == 0


# -- the teacher's next-token entropy ---------------------------------------------------------


def entropy_oracle(logits: torch.Tensor, rows: torch.Tensor, vocab: int) -> torch.Tensor:
    """-sum_v p log p of the first `vocab` columns, from an explicit softmax (float64)."""
    z = logits[rows, :vocab].double()
    p = z.exp() / z.exp().sum(-1, keepdim=True)
    return -(p * p.log()).sum(-1)


@pytest.mark.parametrize("chunk_tokens,chunk_vocab", [(1, None), (4, 5), (1024, None), (2, 1), (3, 36)])
@pytest.mark.parametrize("vocab", [V, V - 6])
def test_streamed_entropy_equals_the_full_softmax_entropy(problem, chunk_tokens, chunk_vocab, vocab):
    logits, rows, _, _ = problem
    got = chunked_token_entropy(logits, rows, vocab_size=vocab, chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab)
    torch.testing.assert_close(got, entropy_oracle(logits, rows, vocab), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(reference_token_entropy(logits, rows, vocab_size=vocab), got, rtol=1e-12, atol=1e-12)


def test_float32_entropy_is_within_1e_5_of_float64_and_stays_finite_for_extreme_logits(problem):
    logits, rows, _, _ = problem
    got = chunked_token_entropy(logits.float(), rows, chunk_vocab=7)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), entropy_oracle(logits, rows, V), rtol=0, atol=1e-5)
    peaked = logits * 1e3  # one-hot distributions: entropy 0, no overflow
    extreme = chunked_token_entropy(peaked.float(), rows, chunk_vocab=7)
    assert torch.isfinite(extreme).all() and extreme.abs().max() < 1e-5
    flat = chunked_token_entropy(torch.zeros(2, V), torch.tensor([0, 1]), chunk_vocab=4)
    torch.testing.assert_close(flat, torch.full((2,), math.log(V)))


@pytest.mark.parametrize("world,vocab", [(2, V), (3, V), (3, 26)])
def test_sharded_entropy_with_a_reducer_equals_the_unsharded_one(problem, world, vocab):
    """(3, 26): the third rank's shard is all vocabulary padding."""
    logits, rows, _, _ = problem
    shard = -(-V // world)
    padded = torch.cat([logits, torch.zeros(M, shard * world - V, dtype=logits.dtype)], dim=1)
    reducer = ThreadReducer(world)
    results: dict[int, torch.Tensor] = {}

    def run(rank: int) -> None:
        results[rank] = chunked_token_entropy(
            padded[:, rank * shard : (rank + 1) * shard],
            rows,
            vocab_size=vocab,
            vocab_start=rank * shard,
            chunk_tokens=4,
            chunk_vocab=5,
            reducer=reducer.for_rank(rank),
        )

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want = entropy_oracle(logits, rows, vocab)
    for rank in range(world):  # every rank gets the entropy over the whole vocabulary
        torch.testing.assert_close(results[rank], want, rtol=1e-12, atol=1e-12)
