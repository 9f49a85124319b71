"""Student log-probabilities on a few token ids without materialising full-vocabulary log-probs.

The SDPO top-K loss needs, for each response token n, log p(v) = z_n[v] - logsumexp(z_n) at K+1
ids (the student's top-K and the sampled token). Done naively that is a float32 [N, V] log-softmax
(plus its autograd copies) for a whole micro-batch: tens of GiB at V = 151936. Here the
logsumexp is streamed over tiles of `chunk_tokens` rows x `chunk_vocab` columns, the K+1 logits
are gathered directly, and the backward pass recomputes softmax one tile at a time and writes
the logits gradient in place:

    d log p(v_k) / d z[u] = [u == v_k] - softmax(z)[u]
    grad z[u] = sum_k g_k [u == v_k] - softmax(z)[u] * sum_k g_k

so the only full-size tensor is the logits gradient itself (in the logits' dtype), which any
loss on those logits must produce.

Vocabulary sharding (tensor parallelism): a rank passes its shard of the columns, the offset of
that shard (`vocab_start`) and a `VocabReducer` that all-reduces across the ranks holding the
other shards. Each rank's logsumexp is combined as m + log(sum_r exp(lse_r - m)) with m the max
over ranks, and a gathered logit comes from the one rank whose shard holds that id (the others
contribute 0). The backward needs no communication when the upstream gradient is the same on
every rank of the group (the loss is computed redundantly on every tensor-parallel rank, as in
Megatron's vocab-parallel cross-entropy). This module stays free of torch.distributed; the
reducer over a process group lives in `tasks.megatron.vocab_parallel`.

`compile=True` runs each tile through `torch.compile`d functions, so a bf16 tile is read once
into registers instead of being copied to float32 first.

The teacher's next-token entropy over the full vocabulary (`chunked_token_entropy`, forward only)
streams the same way: per row a running max m, s = sum exp(z - m) and u = sum exp(z - m) (z - m),
so H = log s - u / s; shards combine after one max and one sum across the ranks.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = [
    "VocabReducer",
    "chunked_token_entropy",
    "chunked_token_logprobs",
    "reference_token_entropy",
    "reference_token_logprobs",
]


class VocabReducer(Protocol):
    """In-place all-reduce across the ranks holding the other vocabulary shards (all must call)."""

    def max_(self, tensor: Tensor) -> None: ...

    def sum_(self, tensor: Tensor) -> None: ...


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types and float32, float64 kept (tests compare in float64)."""
    return torch.promote_types(dtype, torch.float32)


def _tile_logsumexp(columns: Tensor, rows: Tensor) -> Tensor:
    """logsumexp of the given rows of a column slice: [M, Vc], [C] -> [C] (compute dtype)."""
    x = columns.index_select(0, rows).to(_compute_dtype(columns.dtype))  # [C, Vc]
    return torch.logsumexp(x, dim=-1)


def _tile_softmax_grad(columns: Tensor, rows: Tensor, lse: Tensor, gsum: Tensor) -> Tensor:
    """-softmax(z)[rows, slice] * gsum: the dense part of the gradient, in the logits' dtype: [C, Vc]."""
    x = columns.index_select(0, rows).to(lse.dtype)  # [C, Vc]
    return (-(x - lse[:, None]).exp() * gsum[:, None]).to(columns.dtype)


_COMPILED: dict[str, Any] = {}


def _tile_fns(compile: bool) -> tuple[Any, Any]:
    if not compile:
        return _tile_logsumexp, _tile_softmax_grad
    if not _COMPILED:
        # dynamic=None: the first shape is specialised, a second one (the last, shorter tile, or
        # another micro-batch length) recompiles once with dynamic sizes.
        _COMPILED["lse"] = torch.compile(_tile_logsumexp, dynamic=None)
        _COMPILED["grad"] = torch.compile(_tile_softmax_grad, dynamic=None)
    return _COMPILED["lse"], _COMPILED["grad"]


def _vocabulary_columns(
    logits: Tensor,
    *,
    chunk_tokens: int,
    chunk_vocab: int | None,
    vocab_size: int | None,
    vocab_start: int,
    sharded: bool,
) -> tuple[int, int]:
    """(the global vocabulary size, how many of this shard's columns lie below it), after checking
    the chunk sizes and that an unsharded call has a column to score."""
    if chunk_tokens < 1 or (chunk_vocab is not None and chunk_vocab < 1):
        raise ValueError(f"chunk sizes must be >= 1, got chunk_tokens={chunk_tokens}, chunk_vocab={chunk_vocab}")
    local = logits.shape[1]
    if vocab_size is None:
        if sharded or vocab_start:
            raise ValueError("a vocabulary shard needs vocab_size (the unpadded global vocabulary)")
        vocab_size = local
    valid = max(0, min(local, vocab_size - vocab_start))
    if not sharded and valid < 1:
        raise ValueError(
            f"no vocabulary column below vocab_size={vocab_size} in [{vocab_start}, {vocab_start + local})"
        )
    return vocab_size, valid


def _spans(total: int, size: int) -> list[tuple[int, int]]:
    return [(start, min(start + size, total)) for start in range(0, total, size)]


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        rows: Tensor,
        ids: Tensor,
        vocab_start: int,
        valid: int,
        chunk_tokens: int,
        chunk_vocab: int,
        reducer: VocabReducer | None,
        compile: bool,
    ) -> Tensor:
        lse_fn, _ = _tile_fns(compile)
        dtype = _compute_dtype(logits.dtype)
        n = rows.shape[0]
        lse = torch.full((n,), float("-inf"), dtype=dtype, device=logits.device)  # [N]
        for t0, t1 in _spans(n, chunk_tokens):
            for v0, v1 in _spans(valid, chunk_vocab):
                lse[t0:t1] = torch.logaddexp(lse[t0:t1], lse_fn(logits[:, v0:v1], rows[t0:t1]))
        local_ids = ids - vocab_start  # [N, K]
        inside = (local_ids >= 0) & (local_ids < valid)  # [N, K]
        local_ids = local_ids.clamp(0, max(valid - 1, 0))
        picked = logits[rows[:, None], local_ids].to(dtype)  # [N, K]
        picked = torch.where(inside, picked, torch.zeros_like(picked))
        if reducer is not None:
            top = lse.clone()
            reducer.max_(top)
            top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
            total = (lse - top).exp()
            reducer.sum_(total)
            lse = top + total.log()
            reducer.sum_(picked)
        ctx.save_for_backward(logits, rows, local_ids, inside, lse)
        ctx.config = (valid, chunk_tokens, chunk_vocab, compile)
        return picked - lse[:, None]

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        logits, rows, local_ids, inside, lse = ctx.saved_tensors
        valid, chunk_tokens, chunk_vocab, compile = ctx.config
        _, grad_fn = _tile_fns(compile)
        grad_out = grad_out.to(lse.dtype)  # [N, K]
        gsum = grad_out.sum(dim=-1)  # [N]
        grad = torch.zeros_like(logits)  # [M, V]
        for t0, t1 in _spans(rows.shape[0], chunk_tokens):
            r = rows[t0:t1]
            for v0, v1 in _spans(valid, chunk_vocab):
                grad[:, v0:v1].index_copy_(0, r, grad_fn(logits[:, v0:v1], r, lse[t0:t1], gsum[t0:t1]))
        # The indicator part, accumulated (an id may repeat in a row, e.g. the sampled token is
        # also in the top-K); ids of other shards add exact zeros.
        values = torch.where(inside, grad_out, torch.zeros_like(grad_out)).to(grad.dtype)
        grad.index_put_((rows[:, None].expand_as(local_ids), local_ids), values, accumulate=True)
        return grad, None, None, None, None, None, None, None, None


def chunked_token_logprobs(
    logits: Tensor,
    rows: Tensor,
    ids: Tensor,
    *,
    vocab_size: int | None = None,
    vocab_start: int = 0,
    chunk_tokens: int = 1024,
    chunk_vocab: int | None = None,
    reducer: VocabReducer | None = None,
    compile: bool = False,
) -> Tensor:
    """log softmax(logits[rows])[ids], streamed: [M, V_local], [N], [N, K] -> [N, K].

    `logits` holds M positions over this rank's vocabulary columns [vocab_start, vocab_start +
    V_local) (all of them when unsharded), in any float dtype; columns at or past `vocab_size`
    (Megatron's vocabulary padding) are left out of the softmax and get a zero gradient. `rows`
    are distinct indices into M (the positions whose logits predict a scored token); `ids` are
    global vocabulary ids. The result is float32 (float64 for float64 logits) and differentiable
    with respect to `logits`. With a `reducer`, every rank of the group must call with the same
    rows and ids.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [M, V], got {tuple(logits.shape)}")
    if rows.ndim != 1 or ids.ndim != 2 or ids.shape[0] != rows.shape[0]:
        raise ValueError(f"rows must be [N] and ids [N, K], got {tuple(rows.shape)} and {tuple(ids.shape)}")
    vocab_size, valid = _vocabulary_columns(
        logits, chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab, vocab_size=vocab_size,
        vocab_start=vocab_start, sharded=reducer is not None,
    )  # fmt: skip
    if rows.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"ids outside [0, {vocab_size}): min {lo}, max {hi}")
        if int(rows.min()) < 0 or int(rows.max()) >= logits.shape[0]:
            raise ValueError(f"rows outside [0, {logits.shape[0]}): min {int(rows.min())}, max {int(rows.max())}")
        if torch.unique(rows).numel() != rows.numel():
            raise ValueError("rows must be distinct (each scored position once)")
    # torch declares Function.apply without annotations (`apply(cls, *args, **kwargs)`).
    out: Tensor = _ChunkedTokenLogprobs.apply(  # type: ignore[no-untyped-call]
        logits,
        rows.long(),
        ids.long(),
        int(vocab_start),
        int(valid),
        int(chunk_tokens),
        int(chunk_vocab or max(valid, 1)),
        reducer,
        bool(compile),
    )
    return out


def reference_token_logprobs(logits: Tensor, rows: Tensor, ids: Tensor, *, vocab_size: int | None = None) -> Tensor:
    """The unchunked definition (a full [N, V] log-softmax), for tests and benchmarks."""
    vocab_size = logits.shape[1] if vocab_size is None else vocab_size
    x = logits[rows, :vocab_size].to(_compute_dtype(logits.dtype))  # [N, V]
    return torch.log_softmax(x, dim=-1).gather(-1, ids.long())


def _rescale(s: Tensor, u: Tensor, m: Tensor, top: Tensor) -> tuple[Tensor, Tensor]:
    """(s, u) of rows whose running max is m, re-expressed relative to a max `top` >= m.

    With d = m - top <= 0: s' = s e^d and u' = e^d (u + s d). Rows with no column yet (m = -inf,
    s = u = 0) stay at 0.
    """
    seen = torch.isfinite(m)
    d = torch.where(seen, m - top, torch.zeros_like(m))
    scale = torch.where(seen, d.exp(), torch.zeros_like(m))
    return s * scale, scale * (u + s * d)


@torch.no_grad()
def chunked_token_entropy(
    logits: Tensor,
    rows: Tensor,
    *,
    vocab_size: int | None = None,
    vocab_start: int = 0,
    chunk_tokens: int = 1024,
    chunk_vocab: int | None = None,
    reducer: VocabReducer | None = None,
) -> Tensor:
    """Entropy -sum_v p(v) log p(v) of softmax(logits[rows]) over the full vocabulary, in nats: [N].

    Forward only. `logits`, `rows`, `vocab_size`, `vocab_start` and `reducer` are as in
    `chunked_token_logprobs` (columns at or past `vocab_size` are padding and left out; with a
    reducer every rank of the group calls with the same rows and all get the same result). The
    result is float32 (float64 for float64 logits).
    """
    if logits.ndim != 2 or rows.ndim != 1:
        raise ValueError(f"logits must be [M, V] and rows [N], got {tuple(logits.shape)} and {tuple(rows.shape)}")
    vocab_size, valid = _vocabulary_columns(
        logits, chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab, vocab_size=vocab_size,
        vocab_start=vocab_start, sharded=reducer is not None,
    )  # fmt: skip
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= logits.shape[0]):
        raise ValueError(f"rows outside [0, {logits.shape[0]}): min {int(rows.min())}, max {int(rows.max())}")
    dtype = _compute_dtype(logits.dtype)
    n = rows.shape[0]
    m = torch.full((n,), float("-inf"), dtype=dtype, device=logits.device)  # [N] running max
    s = torch.zeros((n,), dtype=dtype, device=logits.device)  # [N] sum exp(z - m)
    u = torch.zeros((n,), dtype=dtype, device=logits.device)  # [N] sum exp(z - m) (z - m)
    rows = rows.long()
    for t0, t1 in _spans(n, chunk_tokens):
        for v0, v1 in _spans(valid, chunk_vocab or max(valid, 1)):
            x = logits[:, v0:v1].index_select(0, rows[t0:t1]).to(dtype)  # [C, Vc]
            tile_max = x.max(dim=-1).values  # [C]
            top = torch.maximum(m[t0:t1], tile_max)
            shifted = x - top[:, None]
            e = shifted.exp()
            s_old, u_old = _rescale(s[t0:t1], u[t0:t1], m[t0:t1], top)
            s[t0:t1] = s_old + e.sum(dim=-1)
            u[t0:t1] = u_old + (e * shifted).sum(dim=-1)
            m[t0:t1] = top
    if reducer is not None:
        top = m.clone()
        reducer.max_(top)
        s, u = _rescale(s, u, m, top)
        both = torch.stack([s, u])  # [2, N]
        reducer.sum_(both)
        s, u = both[0], both[1]
    return s.log() - u / s


def reference_token_entropy(logits: Tensor, rows: Tensor, *, vocab_size: int | None = None) -> Tensor:
    """The unchunked definition (a full [N, V] softmax), for tests."""
    vocab_size = logits.shape[1] if vocab_size is None else vocab_size
    logprobs = torch.log_softmax(logits[rows, :vocab_size].to(_compute_dtype(logits.dtype)), dim=-1)  # [N, V]
    return -(logprobs.exp() * logprobs).sum(dim=-1)
