"""The embedded engine's RMSNorms as one kernel each (Triton, on a GPU).

transformers' Qwen3 RMSNorm is six kernels (the float32 copy, square, mean, add and rsqrt, the
product, the cast and the weight's product); a decode step of a 28-layer Qwen3 runs 113 of them
(two per layer, the query and key norms per layer, the final one), 680 kernels of a few
microseconds each on [rows, 1024] or [rows, heads, 128]: about 2 ms of a 16 ms captured step
on one H100 at 512 rows. `fused_rms_norm` is the same arithmetic in one pass per row: the row in
float32, times rsqrt(mean of squares + eps), cast to the input dtype, times the weight (the
product rounded to the input dtype, as torch multiplies two bf16 tensors).

`use_fused_rms_norms(model)` routes every RMSNorm module of an HF model whose forward has that
form (a `weight` and a `variance_epsilon`) through it; non-contiguous inputs keep the module's
own forward.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["fused_rms_norm", "use_fused_rms_norms"]


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)) over the last dimension; x contiguous on CUDA."""
    d = x.shape[-1]
    if weight.shape != (d,) or not x.is_contiguous() or x.device.type != "cuda":
        raise ValueError(f"fused_rms_norm takes a contiguous CUDA x [..., {weight.shape}]; got {tuple(x.shape)}")
    out = torch.empty_like(x)
    rows = x.numel() // d
    if rows:
        block = 1 << (d - 1).bit_length()
        _kernel()[(rows,)](x, weight, out, d, eps, BLOCK_D=block, num_warps=4 if block <= 1024 else 8)
    return out


def use_fused_rms_norms(model: torch.nn.Module) -> int:
    """Route `model`'s RMSNorms through `fused_rms_norm` (in place); returns how many."""
    count = 0
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "variance_epsilon", None), float):
            module.forward = functools.partial(_forward, module, module.forward)
            count += 1
    return count


def _forward(module: Any, own: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    if not hidden_states.is_contiguous() or hidden_states.dtype != module.weight.dtype:
        return own(hidden_states)
    return fused_rms_norm(hidden_states, module.weight, module.variance_epsilon)


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, defined on first use (Triton is imported only on a GPU)."""
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm(X, W, Out, D, eps, BLOCK_D: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        inside = cols < D
        x = tl.load(X + row * D + cols, mask=inside, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
        normed = (x * rstd).to(Out.dtype.element_ty).to(tl.float32)
        w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(Out + row * D + cols, (w * normed).to(Out.dtype.element_ty), mask=inside)

    return rms_norm
