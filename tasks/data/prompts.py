"""Prompt data for a run: the train / eval splits and the deterministic per-iteration cursor."""

from __future__ import annotations

import functools
import logging
import random
from typing import Any

import numpy as np

from tasks.config import DataConfig

logger = logging.getLogger(__name__)

Row = dict[str, Any]


_SPLITS: dict[str, tuple[list[Row], list[Row]]] = {}  # key -> splits; a few runs' worth at most
_SPLITS_KEPT = 4


def _splits_key(data: DataConfig, seed: int) -> str:
    """What the splits depend on: the data config, the seed and, for prepared files, each file's
    size and modification stamp as its store reports them (a file replaced in place is read anew)."""
    import json

    from storage.urls import resolve

    files = {}
    for url in (data.path, data.eval_path):
        if url:
            fs, path = resolve(url, None)
            info = fs.info(path)  # an Arrow folder: every file's own stamp
            files[url] = fs.ls(path, detail=True) if info["type"] == "directory" else info
    return json.dumps([data.model_dump(mode="json"), seed, files], sort_keys=True, default=str)


def load_splits(data: DataConfig, *, seed: int) -> tuple[list[Row], list[Row]]:
    """(train rows, eval rows) for the configured data source.

    Read and checked once per process for the same config, seed and files (an iteration's stages
    ask for them every iteration); each call gets its own lists of the shared rows, which no
    caller changes.
    """
    key = _splits_key(data, seed)
    if key not in _SPLITS:
        if len(_SPLITS) >= _SPLITS_KEPT:
            _SPLITS.pop(next(iter(_SPLITS)))
        _SPLITS[key] = _read_splits(data, seed=seed)
    train, held_out = _SPLITS[key]
    return list(train), list(held_out)


def _read_splits(data: DataConfig, *, seed: int) -> tuple[list[Row], list[Row]]:
    if data.source == "arithmetic":
        from tasks.data.demo import make_splits

        return make_splits(
            max_operand=data.max_operand,
            eval_fraction=data.eval_fraction,
            answer_width=data.answer_width,
            template=data.prompt_template,
            seed=seed,
        )
    if data.source == "easy_code":
        from tasks.data.easy_code import make_splits as make_code_splits

        return make_code_splits(seed=seed, eval_fraction=data.eval_fraction)
    from tasks.data.schema import check_disjoint, read_checked

    assert data.path is not None  # DataConfig requires it for source=prepared
    rows, places = read_checked(data.path)  # every row checked against the schema (tasks/data/schema.py)
    eval_path = data.eval_path
    if eval_path:
        held_out, held_out_places = read_checked(eval_path)
        check_disjoint(rows, places, held_out, held_out_places)
        return rows, held_out
    # no separate eval file: hold out a seeded fraction of the rows
    order = list(range(len(rows)))
    random.Random(f"split:{seed}").shuffle(order)
    cut = max(1, round(data.eval_fraction * len(rows)))
    return [rows[i] for i in order[cut:]], [rows[i] for i in order[:cut]]


def training_rows(data: DataConfig, *, seed: int) -> list[Row]:
    """The rows iterations draw their prompts from: the training split, or the rows named by
    `data.questions` (looked up in both splits, in the order given). ValueError names a missing id."""
    train_rows, eval_rows = load_splits(data, seed=seed)
    if not data.questions:
        return train_rows
    by_id = {row["prompt_id"]: row for row in (*train_rows, *eval_rows)}
    missing = [q for q in data.questions if q not in by_id]
    if missing:
        sample = ", ".join(sorted(by_id)[:3])
        raise ValueError(
            f"data.questions names prompt ids the data does not hold: {missing}; ids look like {sample}, ..."
        )
    return [by_id[q] for q in data.questions]


def iteration_prompts(rows: list[Row], *, iteration: int, per_iteration: int, seed: int) -> list[Row]:
    """The prompts of iteration `iteration` (1-based): a seeded pass over shuffled epochs.

    Epoch e is `rows` shuffled with seed (seed, e); iteration n takes the slice
    [(n-1)*P, n*P) of the concatenated epochs. The same (rows, n, P, seed) always gives the same
    prompts, so a restarted iteration samples the same questions.
    """
    if iteration < 1:
        raise ValueError(f"iteration={iteration}; iterations are numbered from 1")
    if not rows:
        raise ValueError("the training split is empty")
    size = len(rows)
    start = (iteration - 1) * per_iteration
    out: list[Row] = []
    position = start
    while len(out) < per_iteration:
        epoch, offset = divmod(position, size)
        order = epoch_order(size, seed=seed, epoch=epoch)
        take = min(per_iteration - len(out), size - offset)
        out.extend(rows[i] for i in order[offset : offset + take].tolist())
        position += take
    return out


@functools.lru_cache(maxsize=2)  # an iteration spans at most two epochs
def epoch_order(size: int, *, seed: int, epoch: int) -> np.ndarray:
    """Epoch `epoch`'s order of `size` rows (read-only): range(size) shuffled by `random.Random`
    seeded with "seed:epoch". Shuffled once per process and epoch, not per iteration: a million rows
    take about half a second to shuffle."""
    order = list(range(size))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    array = np.asarray(order, dtype=np.int64)
    array.setflags(write=False)
    return array
