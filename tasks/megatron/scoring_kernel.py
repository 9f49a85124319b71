"""The teacher's scores of every response position in one pass over its logits (Triton, on a GPU).

For each scored row of logits (a position that predicts a response token) the teacher stage needs
the log-probs at the student's K top ids and at the sampled id, and the entropy of the whole
distribution. Computed with torch ops on [chunk, V] float32 copies, that is a dozen passes over
the 151,936-wide rows (the float copy, max, subtract, exp, sum, log, the entropy's product and
sum...), each a kernel of its own: on one H100 the 0.6B teacher's scoring of 512 answers spent
1.4 s in them and 0.5 s copying, against 0.5 s in its GEMMs.

`fused_token_scores` reads each row once, in vocabulary blocks, keeping three running float32
sums per row (the online maximum m, s = sum exp(x - m), t = sum exp(x - m) * x), so that
logsumexp = m + log s and entropy = logsumexp - t / s; then it reads the K+1 ids' logits.
Columns at and past `vocab_size` (Megatron's padding) are left out. Tensor parallelism keeps the
chunked torch path (`tasks.megatron.vocab_parallel`), whose shards need all-reduces.
`reference_token_scores` is the same in torch, which the GPU tests hold the kernel to.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["fused_token_scores", "reference_token_scores"]

_BLOCK_V = 4096  # vocabulary columns a program reads per step


def reference_token_scores(
    logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, *, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [M, V'] (any float dtype), rows [N], ids [N, K] -> (log-probs [N, K], entropy [N]), float32."""
    x = logits.index_select(0, rows)[:, :vocab_size].float()
    lse = torch.logsumexp(x, dim=-1)
    p = torch.softmax(x, dim=-1)
    entropy = lse - (p * x).sum(dim=-1)
    return x.gather(1, ids.long()) - lse[:, None], entropy


def fused_token_scores(
    logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, *, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring: the Triton kernel on CUDA, `reference_token_scores` elsewhere."""
    if logits.ndim != 2 or rows.ndim != 1 or ids.ndim != 2 or ids.shape[0] != rows.shape[0]:
        raise ValueError(f"takes logits [M, V], rows [N], ids [N, K]; got {logits.shape}, {rows.shape}, {ids.shape}")
    if logits.shape[1] < vocab_size:
        raise ValueError(f"logits hold {logits.shape[1]} columns, fewer than vocab_size={vocab_size}")
    if logits.device.type != "cuda":
        return reference_token_scores(logits, rows, ids, vocab_size=vocab_size)
    n, k = ids.shape
    logprobs = torch.empty((n, k), dtype=torch.float32, device=logits.device)
    entropy = torch.empty((n,), dtype=torch.float32, device=logits.device)
    if n == 0:
        return logprobs, entropy
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows = rows.to(torch.int64).contiguous()
    ids = ids.to(torch.int64).contiguous()
    _kernel()[(n,)](
        logits, logits.stride(0), rows, ids, logprobs, entropy, vocab_size, k,
        BLOCK_V=_BLOCK_V, BLOCK_K=max(16, 1 << (k - 1).bit_length()), num_warps=8,
    )  # fmt: skip
    return logprobs, entropy


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, defined on first use (Triton is imported only on a GPU)."""
    import triton
    import triton.language as tl

    @triton.jit
    def scores(
        Logits, stride, Rows, Ids, LogProbs, Entropy, V, K,
        BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0)
        base = Logits + tl.load(Rows + i) * stride
        cols = tl.arange(0, BLOCK_V)
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        t = tl.zeros((), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            inside = v0 + cols < V
            x = tl.load(base + v0 + cols, mask=inside, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            alpha = tl.exp(m - m_new)
            e = tl.exp(x - m_new)  # 0 outside the vocabulary
            s = s * alpha + tl.sum(e, 0)
            t = t * alpha + tl.sum(e * tl.where(inside, x, 0.0), 0)
            m = m_new
        lse = m + tl.log(s)
        tl.store(Entropy + i, lse - t / s)
        ks = tl.arange(0, BLOCK_K)
        wanted = ks < K
        ids = tl.load(Ids + i * K + ks, mask=wanted, other=0)
        x = tl.load(base + ids, mask=wanted, other=0.0).to(tl.float32)
        tl.store(LogProbs + i * K + ks, x - lse, mask=wanted)

    return scores
