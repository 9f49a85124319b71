"""Synthetic but realistic shard rows, for tests and the storage benchmark.

Top-K rows look like a language model's: candidate ids follow a Zipf unigram law over the vocabulary
(frequent tokens have low ids, loosely, as in BPE vocabularies), logprobs are sorted descending with
most tokens confident (top-1 probability median ~0.8) and a tail of mass outside the top K, and the
sampled token is drawn from the top-K distribution. Uniform random data would make compression
figures meaningless.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from storage.shard_columns import Ragged

_WORDS = ("the", "answer", "is", "so", "we", "get", "x", "=", "2", "+", "3", "then", "therefore", "box", "step")


@functools.cache
def _zipf_tables(vocab: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(12345)
    cdf = np.cumsum(np.arange(1, vocab + 1, dtype=np.float64) ** -1.1)
    cdf /= cdf[-1]
    rank_to_id = np.argsort(np.arange(vocab) * np.exp(rng.normal(0.0, 1.0, vocab))).astype(np.int32)
    return cdf, rank_to_id


def synthetic_topk(n_tokens: int, k: int, *, vocab: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(ids [n_tokens, k] int32, distinct per token; logprobs [n_tokens, k] float32, descending)."""
    if k > vocab:
        raise ValueError(f"k = {k} exceeds vocab = {vocab}")
    cdf, rank_to_id = _zipf_tables(vocab)
    ranks = np.searchsorted(cdf, rng.random((n_tokens, k))).astype(np.int64)
    for _ in range(32):  # redraw repeated candidates until each token's k ids are distinct
        order = np.argsort(ranks, axis=1, kind="stable")
        ordered = np.take_along_axis(ranks, order, axis=1)
        repeat = np.zeros_like(ordered, dtype=bool)
        repeat[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
        if not repeat.any():
            break
        mask = np.zeros_like(repeat)
        np.put_along_axis(mask, order, repeat, axis=1)
        ranks[mask] = rng.integers(0, vocab, int(mask.sum()))
    else:
        raise RuntimeError("could not draw distinct top-k ids")
    confident = rng.random(n_tokens) < 0.7
    scale = np.where(confident, rng.lognormal(np.log(4.0), 0.5, n_tokens), rng.lognormal(np.log(0.7), 0.5, n_tokens))
    gaps = rng.exponential(1.0, (n_tokens, k)) * scale[:, None]
    gaps[:, 0] = 0.0
    logits = -np.cumsum(gaps, axis=1)  # [N, K] descending
    tail = np.exp(logits[:, -1]) * np.exp(rng.uniform(0.0, np.log(50.0), n_tokens))  # mass beyond the top K
    logz = np.log(np.exp(logits).sum(axis=1) + tail)
    return rank_to_id[ranks], (logits - logz[:, None]).astype(np.float32)


def synthetic_columns(
    *,
    iteration: int,
    n_rows: int,
    top_k: int,
    rng: np.random.Generator,
    response_len: tuple[int, int] = (16, 64),
    vocab: int = 151_936,
    group_size: int = 4,
    first_sample_id: int = 0,
    teacher: bool = False,
) -> dict[str, Any]:
    """A column dict for `ShardWriter.write` (rollout columns; plus teacher columns if `teacher`)."""
    lo, hi = response_len
    lengths = rng.integers(lo, hi + 1, n_rows)  # [N]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    n_tokens = int(offsets[-1])
    ids, logprobs = synthetic_topk(n_tokens, top_k, vocab=vocab, rng=rng)
    probs = np.exp(logprobs.astype(np.float64))
    cumulative = np.cumsum(probs, axis=1)
    pick = (cumulative < rng.random(n_tokens)[:, None] * cumulative[:, -1:]).sum(axis=1)  # [T] index in top K
    rows = np.arange(n_tokens)
    sample_ids = np.arange(first_sample_id, first_sample_id + n_rows, dtype=np.int64)
    group_ids = sample_ids // group_size
    prompt_lengths = rng.integers(8, 32, n_rows)
    prompt_offsets = np.concatenate([[0], np.cumsum(prompt_lengths)])
    words = np.array(_WORDS)
    columns: dict[str, Any] = {
        "sample_id": sample_ids,
        "group_id": group_ids,
        "prompt_id": [f"prompt-{g}" for g in group_ids],
        "iteration": np.full(n_rows, iteration, dtype=np.int32),
        "prompt_messages": [[{"role": "user", "content": f"Solve problem {g}."}] for g in group_ids],
        "prompt_ids": Ragged(rng.integers(0, vocab, int(prompt_offsets[-1])).astype(np.int32), prompt_offsets),
        "response_ids": Ragged(ids[rows, pick], offsets),
        "response_text": [" ".join(rng.choice(words, size=int(n))) for n in lengths],
        "sampled_logprobs": Ragged(logprobs[rows, pick], offsets),
        "topk_ids": Ragged(ids, offsets),
        "topk_logprobs": Ragged(logprobs, offsets),
        "finish_reason": np.where(lengths == hi, "length", "stop").tolist(),
        "reward": (rng.random(n_rows) < 0.5).astype(np.float32),
        "feedback": [None if r % 3 else "wrong sign in step 2" for r in range(n_rows)],
        "format_error": np.zeros(n_rows, dtype=bool),
        "label": [str(g % 10) for g in group_ids],
        "data_source": ["synthetic_math"] * n_rows,
        "teacher_prompt": [None] * n_rows,
        "extra_json": ["{}"] * n_rows,
    }
    if teacher:
        noise = rng.normal(0.0, 0.3, logprobs.shape).astype(np.float32)
        teacher_topk = np.minimum(logprobs + noise, 0.0)
        teacher_lengths = prompt_lengths + 16
        teacher_offsets = np.concatenate([[0], np.cumsum(teacher_lengths)])
        columns |= {
            "teacher_prompt_ids": Ragged(
                rng.integers(0, vocab, int(teacher_offsets[-1])).astype(np.int32), teacher_offsets
            ),
            "teacher_prompt_text": [f"Solve problem {g}. A correct attempt: ..." for g in group_ids],
            "teacher_source": ["demo"] * n_rows,
            "sample_mask": rng.random(n_rows) < 0.8,
            "teacher_topk_logprobs": Ragged(teacher_topk, offsets),
            "teacher_sampled_logprobs": Ragged(teacher_topk[rows, pick], offsets),
            "advantage": (columns["reward"] - 0.5).astype(np.float32),
            "route": [None] * n_rows,
            "pass_rate": np.full(n_rows, 0.5, dtype=np.float32),
            # the top-K share of the teacher's entropy (no draw from rng: the stream stays as it was)
            "teacher_entropy": Ragged(-(np.exp(teacher_topk) * teacher_topk).sum(axis=1).astype(np.float32), offsets),
        }
    return columns
