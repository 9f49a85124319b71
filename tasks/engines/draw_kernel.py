"""A decode step's draw in two passes over each row's logits (Triton, on a GPU).

`tasks.engines.sampling.draw` inverts the CDF of softmax(logits / T) in vocabulary order at a
uniform u: softmax, cumsum and a search, each a pass over [B, V] float32, after a log-softmax
for the recorded log-probs. At 512 rows of the Qwen3 vocabulary (151,936) on one H100 those
passes and the top-K were 2.6 ms of a 16 ms captured decode step.

`fused_draw` reads each row twice, in vocabulary blocks and in the logits' own dtype: pass 1
keeps the online maximum and sum of exponentials (of logits / T, and of the logits themselves
for the log-probs when T != 1); pass 2 walks the blocks again, accumulating exp(y - m), and takes
the first id with mass whose running sum reaches u times the total: the same inverse CDF,
unnormalised (u = 0 takes the first id with mass, where the torch draw takes id 0). Should
round-off carry the target past the last sum, the last id with mass is taken. Either draw sums
150k float32 terms in its own order, so the two pick neighbouring ids for about 1-2 % of rows of
random logits: both are the inverse CDF within float32 round-off (tests/gpu/test_gpu_kernels.py
holds the kernel to a float64 one). Returns the ids and the rows' logsumexp of the (unscaled) logits, from which
the recorded log-probs follow. Greedy decoding (`draw=False`) runs pass 1 alone.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["fused_draw"]

_BLOCK_V = 2048  # vocabulary columns a program reads per step


def fused_draw(
    logits: torch.Tensor, u: torch.Tensor | None, *, temperature: float
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """logits [B, V] (CUDA, any float dtype), u [B] in [0, 1) or None (greedy: no draw) ->
    (ids [B] int64 or None, logsumexp of the logits [B] float32)."""
    if logits.ndim != 2 or logits.device.type != "cuda":
        raise ValueError(f"fused_draw takes CUDA logits [B, V]; got {tuple(logits.shape)} on {logits.device}")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 for a draw")
    b, v = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    lse = torch.empty((b,), dtype=torch.float32, device=logits.device)
    ids = torch.empty((b,), dtype=torch.int64, device=logits.device) if u is not None else lse  # lse: unused
    _kernel()[(b,)](
        logits, logits.stride(0), u if u is not None else lse, ids, lse, v, 1.0 / temperature,
        DRAW=u is not None, SCALED=temperature != 1.0, BLOCK_V=_BLOCK_V, num_warps=8,
    )  # fmt: skip
    return (ids if u is not None else None), lse


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, defined on first use (Triton is imported only on a GPU)."""
    import triton
    import triton.language as tl

    @triton.jit
    def draw(
        Logits, stride, U, Ids, Lse, V, inv_t,
        DRAW: tl.constexpr, SCALED: tl.constexpr, BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        base = Logits + row * stride
        cols = tl.arange(0, BLOCK_V)
        m = tl.full((), float("-inf"), tl.float32)  # of the logits
        s = tl.zeros((), tl.float32)
        my = tl.full((), float("-inf"), tl.float32)  # of logits / T (the same when T = 1)
        sy = tl.zeros((), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            x = tl.load(base + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
            if SCALED:
                y = x * inv_t
                my_new = tl.maximum(my, tl.max(y, 0))
                sy = sy * tl.exp(my - my_new) + tl.sum(tl.exp(y - my_new), 0)
                my = my_new
        tl.store(Lse + row, m + tl.log(s))
        if DRAW:
            if not SCALED:
                my = m
                sy = s
            target = tl.load(U + row) * sy
            found = tl.full((), -1, tl.int64)
            last = tl.full((), 0, tl.int64)  # the last id with mass so far
            running = tl.zeros((), tl.float32)
            for v0 in range(0, V, BLOCK_V):
                inside = v0 + cols < V
                y = tl.load(base + v0 + cols, mask=inside, other=float("-inf")).to(tl.float32)
                if SCALED:
                    y = y * inv_t
                e = tl.exp(y - my)
                reached = (running + tl.cumsum(e, 0) >= target) & (e > 0)  # an id with mass
                first = tl.min(tl.where(reached, v0 + cols, V), 0).to(tl.int64)
                found = tl.where((found < 0) & (first < V), first, found)
                last = tl.maximum(last, tl.max(tl.where(e > 0, v0 + cols, 0), 0).to(tl.int64))
                running += tl.sum(e, 0)
            tl.store(Ids + row, tl.where(found < 0, last, found))

    return draw
