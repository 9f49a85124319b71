"""One decode step's attention over a fixed-capacity KV cache, bounded by device tensors.

A captured decode step (`tasks.engines.graph_decode`) cannot slice the cache by Python integers
that change every step: the graph would replay the first step's slice forever. Its KV cache keeps
its full capacity [B, g, C, d], and each row attends the columns [start[b], end) given as device
tensors: `start` [B] is where the row's (left-padded) prompt begins, `end` (one element) is one
past the column the step just wrote, the same for every row. The step updates `end` on the device.

`decode_attention(q, k, v, start, end, scale)`: q [B, h, 1, d] with h = g * r query heads, head i
attending KV head i // r (as transformers' `repeat_kv` lays them out); returns [B, 1, h, d].

On CUDA a split-K Triton kernel reads each row's filled columns once (a program per row, KV head
and column chunk, all r query heads of the group at once; a second kernel combines the chunks),
so a step's attention costs the KV cache's filled bytes, not its capacity. Elsewhere the same
function in torch (a masked softmax over the whole capacity): the CPU tests of the captured step
run through it, and the GPU tests hold the kernel to it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["decode_attention", "reference_decode_attention"]

_BLOCK_N = 64  # key columns a kernel iteration reads
_TARGET_PROGRAMS = 1024  # enough programs to fill an H100/H200 (132 SMs) several times over


def reference_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, end: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, h, 1, d], k/v [B, g, C, d], start [B], end [1] -> [B, 1, h, d] (softmax in float32)."""
    b, h, _, d = q.shape
    g, capacity = k.shape[1], k.shape[2]
    grouped = q.reshape(b, g, h // g, d).float()  # [B, g, r, d]
    scores = torch.matmul(grouped, k.float().transpose(-1, -2)) * scale  # [B, g, r, C]
    column = torch.arange(capacity, device=q.device)
    attend = (column[None, :] >= start[:, None]) & (column[None, :] < end)  # [B, C]
    scores = scores.masked_fill(~attend[:, None, None, :], float("-inf"))
    # columns never written hold whatever the allocation held (NaN too): zero weight must meet zeros
    values = v.float().masked_fill(~attend[:, None, :, None], 0.0)
    out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [B, g, r, d]
    return out.to(q.dtype).reshape(b, 1, h, d)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, end: torch.Tensor, scale: float
) -> torch.Tensor:
    """See the module docstring; the Triton kernel on CUDA, `reference_decode_attention` elsewhere."""
    b, h, q_len, d = q.shape
    g = k.shape[1]
    if q_len != 1 or h % g or k.shape != v.shape or k.shape[0] != b or k.shape[-1] != d:
        raise ValueError(f"decode attention takes q [B, h, 1, d] and k/v [B, g, C, d]; got {q.shape}, {k.shape}")
    if q.device.type != "cuda":
        return reference_decode_attention(q, k, v, start, end, scale)
    return _triton_decode_attention(q, k, v, start, end, scale)


def _splits(b: int, g: int, capacity: int) -> tuple[int, int]:
    """(chunks, columns per chunk): enough programs for the device, each chunk whole blocks."""
    blocks = -(-capacity // _BLOCK_N)
    chunks = max(1, min(blocks, -(-_TARGET_PROGRAMS // (b * g))))
    per_chunk = -(-blocks // chunks) * _BLOCK_N
    return -(-capacity // per_chunk), per_chunk


def _triton_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, end: torch.Tensor, scale: float
) -> torch.Tensor:
    partial, combine = _kernels()
    b, h, _, d = q.shape
    g, capacity = k.shape[1], k.shape[2]
    r = h // g
    if k.stride(-1) != 1 or v.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("decode attention reads q, k and v with a contiguous head dimension")
    if d & (d - 1) or d < 16:
        raise ValueError(f"decode attention needs a power-of-two head dimension >= 16, got {d}")
    chunks, per_chunk = _splits(b, g, capacity)
    block_r = max(16, 1 << (r - 1).bit_length())
    acc = torch.empty((b, g, chunks, block_r, d), device=q.device, dtype=torch.float32)
    stats = torch.empty((b, g, chunks, 2, block_r), device=q.device, dtype=torch.float32)  # (max, sum)
    out = torch.empty((b, 1, h, d), device=q.device, dtype=q.dtype)
    qs = q.stride()
    partial[(b, g, chunks)](
        q, k, v, start, end, acc, stats,
        qs[0], qs[1], *k.stride()[:3], *v.stride()[:3],
        scale, per_chunk,
        R=r, BLOCK_R=block_r, D=d, BLOCK_N=_BLOCK_N, CHUNKS=chunks, IEEE=q.dtype == torch.float32,
    )  # fmt: skip
    combine[(b, g)](acc, stats, out, out.stride(0), R=r, BLOCK_R=block_r, D=d, CHUNKS=chunks)
    return out


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """The two Triton kernels, defined on first use (Triton is imported only on a GPU)."""
    import triton
    import triton.language as tl

    @triton.jit
    def partial(
        Q, K, V, Start, End, Acc, Stats,
        sqb, sqh, skb, skg, skc, svb, svg, svc,
        scale, per_chunk,
        R: tl.constexpr, BLOCK_R: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,
        IEEE: tl.constexpr,
    ):  # fmt: skip
        row, group, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        lo = tl.maximum(tl.load(Start + row).to(tl.int32), chunk * per_chunk)
        hi = tl.minimum(tl.load(End).to(tl.int32), (chunk + 1) * per_chunk)
        heads = tl.arange(0, BLOCK_R)
        dims = tl.arange(0, D)
        q = tl.load(
            Q + row * sqb + (group * R + heads)[:, None] * sqh + dims[None, :], mask=heads[:, None] < R, other=0.0
        )
        m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK_R,), tl.float32)
        acc = tl.zeros((BLOCK_R, D), tl.float32)
        k_base = K + row * skb + group * skg
        v_base = V + row * svb + group * svg
        for n0 in range(lo, hi, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            valid = cols < hi
            kt = tl.load(k_base + cols[None, :] * skc + dims[:, None], mask=valid[None, :], other=0.0)  # [D, N]
            # float32 inputs are multiplied in float32, not TF32 (Triton's default), as SDPA does
            if IEEE:
                scores = tl.dot(q, kt, input_precision="ieee") * scale  # [BLOCK_R, N]
            else:
                scores = tl.dot(q, kt) * scale
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            vv = tl.load(v_base + cols[:, None] * svc + dims[None, :], mask=valid[:, None], other=0.0)  # [N, D]
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv)
            s = s * alpha + tl.sum(p, 1)
            m = m_new
        base = (row * tl.num_programs(1) + group) * CHUNKS + chunk
        tl.store(Acc + base * BLOCK_R * D + heads[:, None] * D + dims[None, :], acc)
        tl.store(Stats + base * 2 * BLOCK_R + heads, m)
        tl.store(Stats + base * 2 * BLOCK_R + BLOCK_R + heads, s)

    @triton.jit
    def combine(Acc, Stats, Out, sob, R: tl.constexpr, BLOCK_R: tl.constexpr, D: tl.constexpr, CHUNKS: tl.constexpr):
        row, group = tl.program_id(0), tl.program_id(1)
        heads = tl.arange(0, BLOCK_R)
        dims = tl.arange(0, D)
        base = (row * tl.num_programs(1) + group) * CHUNKS
        m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
        for c in range(CHUNKS):
            m = tl.maximum(m, tl.load(Stats + (base + c) * 2 * BLOCK_R + heads))
        total = tl.zeros((BLOCK_R,), tl.float32)
        out = tl.zeros((BLOCK_R, D), tl.float32)
        for c in range(CHUNKS):
            mc = tl.load(Stats + (base + c) * 2 * BLOCK_R + heads)
            # a chunk with no column of the row holds max -inf and weighs 0 (the row has >= 1 column)
            w = tl.where(mc == float("-inf"), 0.0, tl.exp(mc - m))
            total += w * tl.load(Stats + (base + c) * 2 * BLOCK_R + BLOCK_R + heads)
            out += w[:, None] * tl.load(Acc + (base + c) * BLOCK_R * D + heads[:, None] * D + dims[None, :])
        out = out / total[:, None]
        keep = heads[:, None] < R
        tl.store(
            Out + row * sob + (group * R + heads)[:, None] * D + dims[None, :], out.to(Out.dtype.element_ty), mask=keep
        )

    return partial, combine
