"""Fused kernels for megatron-core on a GPU without Transformer Engine or Apex.

Without TE and Apex, Megatron's local layer spec and optimizer fall back to plain torch code
that is correct but leaves time on the table. This module is the one place that replaces those
fallbacks (`train.fused_kernels: true`, CUDA only); each replacement is a named function whose
docstring says which Megatron code it serves, and `enable_fused_kernels()` applies them all
before the model is built.

- RoPE (`install_rope_fusion`): Megatron fuses rotary embeddings only through TE
  (`rope_utils.fused_apply_rotary_pos_emb[_thd]`); unfused, it spends about eight elementwise
  passes on q and on k per layer, and on packed rows it loops over the samples in Python. The
  replacements `rope_bshd` / `rope_thd` are one torch.compile'd kernel each (eager on the CPU),
  and the packed one gathers per-token positions instead of looping.
- RMSNorm (`CompiledRMSNorm`): the local spec's torch RMSNorm kernels run well below the
  memory bandwidth; `tasks.megatron.model` puts the compiled module in the layer spec instead.
- Gradient norm and clipping (`install_foreach_grad_ops`): the local stand-ins for Apex's
  multi-tensor ops read every parameter's norm back to the host (one device sync per tensor,
  `utils.local_multi_tensor_l2_norm`) and scale with a temporary per tensor
  (`local_multi_tensor_scale`); torch's `_foreach_norm` / `_foreach_mul_` do the same in a few
  kernels with one sync.
- Weight gradients (`install_wgrad_accumulation_fusion`): Megatron accumulates them into the
  fp32 gradient buffer inside the GEMM only through Apex; otherwise a bf16 gradient is written
  and added in a separate pass. The replacement is one torch `addmm` with an fp32 output.
- Logits layout (`batch_first_logits`): GPTModel transposes its [s, b, V] logits to [b, s, V]
  with a copy (and two more in the backward pass); computing them batch-first makes it free.
- AdamW (`use_fused_adamw`): Megatron builds `torch.optim.AdamW` without `fused`, so torch runs
  its multi-tensor "foreach" implementation; the fused CUDA kernel reads and writes each state
  once.

Megatron's own compiled SwiGLU and residual-add fusions need no patch: `tasks.megatron.model`
turns them on through `TransformerConfig` (`bias_activation_fusion`, `bias_dropout_fusion`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

__all__ = [
    "MADE_FOR",
    "rope_bshd",
    "rope_thd",
    "install_rope_fusion",
    "CompiledRMSNorm",
    "foreach_l2_norm",
    "foreach_scale",
    "install_foreach_grad_ops",
    "use_fused_adamw",
    "batch_first_logits",
    "wgrad_gemm_accum",
    "install_wgrad_accumulation_fusion",
    "enable_fused_kernels",
]

# megatron-core versions these replacements were written against and checked with.
MADE_FOR = ("0.16.1", "0.19.2")

_installed: set[str] = set()


def _rope_apply(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Megatron's `_apply_rotary_pos_emb_bshd` (not interleaved, mscale 1) given cos and sin of
    the freqs, already in t's dtype: the first `cos.shape[-1]` channels of t are rotated, the
    rest pass through."""
    rot_dim = cos.shape[-1]
    x, rest = t[..., :rot_dim], t[..., rot_dim:]
    x1, x2 = torch.chunk(x, 2, dim=-1)
    rotated = x * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated, rest), dim=-1)


@functools.cache
def _compiled_rope() -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    return torch.compile(_rope_apply, dynamic=True)


class _CosSinCache:
    """cos and sin of recent freqs tensors, so that the q and k of every layer share one
    computation per forward. Entries hold their freqs tensor, so an id is never reused while
    cached; Megatron's rotary module returns the same freqs tensor for the same length."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self.entries: dict[tuple, tuple[Tensor, Tensor, Tensor]] = {}

    def get(
        self, freqs: Tensor, dtype: torch.dtype, *, length: int, bounds: tuple[int, ...] | None
    ) -> tuple[Tensor, Tensor]:
        """cos and sin in `dtype` of freqs[:length], or of the packed positions of `bounds`."""
        key = (id(freqs), freqs._version, dtype, length, bounds)
        hit = self.entries.pop(key, None)
        if hit is None:
            angles = freqs[:length] if bounds is None else freqs[_packed_positions(bounds, freqs.device)]
            hit = (freqs, torch.cos(angles).to(dtype), torch.sin(angles).to(dtype))
            if len(self.entries) >= self.size:
                self.entries.pop(next(iter(self.entries)))
        self.entries[key] = hit  # most recent last
        return hit[1], hit[2]


_cos_sin = _CosSinCache()


def _rope(t: Tensor, freqs: Tensor, bounds: tuple[int, ...] | None = None) -> Tensor:
    cos, sin = _cos_sin.get(freqs, t.dtype, length=t.shape[0], bounds=bounds)
    if t.dim() == 3:  # packed rows [t, h, d]: angles are [t, 1, 1, d_rot]
        cos, sin = cos.squeeze(1), sin.squeeze(1)
    return _compiled_rope()(t, cos, sin) if t.is_cuda else _rope_apply(t, cos, sin)


def rope_bshd(t: Tensor, freqs: Tensor, transpose_output_memory: bool = False, interleaved: bool = False) -> Tensor:
    """Rotary embedding of t [s, b, h, d] with Megatron's freqs [s, 1, 1, d_rot] (fp32).

    The signature is that of Megatron's TE hook `fused_apply_rotary_pos_emb`.
    """
    if interleaved:
        raise NotImplementedError("interleaved rotary embeddings are not supported by the fused RoPE")
    if freqs.shape[0] < t.shape[0]:
        raise ValueError(f"rotary freqs cover {freqs.shape[0]} positions, the input has {t.shape[0]}")
    return _rope(t, freqs)


@functools.lru_cache(maxsize=16)
def _packed_positions(bounds: tuple[int, ...], device: torch.device) -> Tensor:
    """Per-token positions of a packed row, restarting at 0 at every sample boundary."""
    cu = torch.tensor(bounds, dtype=torch.long)
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])
    return (torch.arange(bounds[-1], dtype=torch.long) - starts).to(device)


def rope_thd(
    t: Tensor,
    cu_seqlens: Tensor,
    freqs: Tensor,
    cp_size: int = 1,
    cp_rank: int = 0,
    interleaved: bool = False,
) -> Tensor:
    """Rotary embedding of packed t [tokens, h, d] whose samples start at `cu_seqlens`.

    Positions restart at every sample, as in Megatron's unfused thd path when freqs
    [max_seqlen, 1, 1, d_rot] are shorter than the row; when they span the whole row (a
    one-sample pack) the positions are the row's own, again as there. Signature of Megatron's
    TE hook `fused_apply_rotary_pos_emb_thd`.
    """
    if interleaved:
        raise NotImplementedError("interleaved rotary embeddings are not supported by the fused RoPE")
    if cp_size != 1:
        raise NotImplementedError(f"context parallel size {cp_size}; the fused RoPE supports 1")
    bounds = tuple(int(b) for b in cu_seqlens.tolist())
    if bounds[0] != 0 or bounds[-1] != t.shape[0]:
        raise ValueError(f"cu_seqlens {bounds} do not cover the {t.shape[0]} packed tokens")
    if freqs.shape[0] == t.shape[0]:
        return _rope(t, freqs)
    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    if longest > freqs.shape[0]:
        raise ValueError(f"rotary freqs cover {freqs.shape[0]} positions, a packed sample has {longest}")
    return _rope(t, freqs, bounds)


def install_rope_fusion() -> None:
    """Make Megatron's `apply_rope_fusion=True` path call `rope_bshd` / `rope_thd`.

    Why: `models/common/embeddings/rope_utils.py` apply_rotary_pos_emb calls the module globals
    `fused_apply_rotary_pos_emb` (bshd) and `fused_apply_rotary_pos_emb_thd` (packed rows) when
    `config.apply_rope_fusion`; both are imported from TE and None without it, and
    `TransformerConfig.__post_init__` refuses the flag while they are None. Binding them here
    (before the config is built) gives the flag a kernel; `attention.py` reaches them through
    `apply_rotary_pos_emb`, so nothing else changes.
    """
    if "rope" in _installed:
        return
    from megatron.core.models.common.embeddings import rope_utils

    for name in ("fused_apply_rotary_pos_emb", "fused_apply_rotary_pos_emb_thd"):
        current = getattr(rope_utils, name)
        if current is not None and current not in (rope_bshd, rope_thd):
            logger.info("rope_utils.%s is already provided (%s); keeping it", name, current)
            _installed.add("rope")
            return
    rope_utils.fused_apply_rotary_pos_emb = rope_bshd
    rope_utils.fused_apply_rotary_pos_emb_thd = rope_thd
    _installed.add("rope")


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


# One function (so one code object) per input rank: dynamo keeps its compiled graphs, and counts
# them against `recompile_limit` (8), per code object. One function for every rank hit the limit
# in a training iteration (rank-3 packed and rank-4 inputs, q/k norms on strided views, with and
# without gradients), after which the norms ran eagerly.
def _rms_norm_rank2(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


def _rms_norm_rank3(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


def _rms_norm_rank4(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


_RMS_NORM_BY_RANK = {2: _rms_norm_rank2, 3: _rms_norm_rank3, 4: _rms_norm_rank4}


@functools.cache
def _compiled_rms_norm(rank: int) -> Callable[[Tensor, Tensor, float], Tensor]:
    if rank not in _RMS_NORM_BY_RANK:
        raise ValueError(f"CompiledRMSNorm takes inputs of rank 2, 3 or 4, got rank {rank}")
    return torch.compile(_RMS_NORM_BY_RANK[rank], dynamic=True)


class CompiledRMSNorm(torch.nn.Module):
    """RMSNorm for Megatron's layer spec (in place of `WrappedTorchNorm`), compiled on CUDA.

    Why: the local spec's `WrappedTorchNorm` is `torch.nn.RMSNorm`, whose CUDA kernels ran at
    about half the memory bandwidth on the H200 (forward ~90 us, backward ~110 us plus a separate
    weight-gradient reduction, for a [16384, 2048] bf16 input), and a Qwen3 layer has four norms
    (input, pre-MLP, q and k). torch.compile generates one kernel for the forward and one for
    the backward. Same constructor as `WrappedTorchNorm`, same parameter name (`weight`), so
    checkpoints and the q/k-norm gradient all-reduce under tensor parallelism (matched by name)
    are unchanged. `compiled = False` runs the eager `rms_norm` (benchmarks switch it).
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> None:
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError(f"CompiledRMSNorm implements RMSNorm, the config asks for {config.normalization!r}")
        if config.sequence_parallel:
            raise NotImplementedError("CompiledRMSNorm does not mark its weight for sequence parallelism")
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.eps = float(eps)
        self.compiled = True

    def forward(self, x: Tensor) -> Tensor:
        if self.compiled and x.is_cuda:
            return _compiled_rms_norm(x.dim())(x, self.weight, self.eps)
        return _rms_norm(x, self.weight, self.eps)


def foreach_l2_norm(
    chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]], per_tensor: bool, *args: Any
) -> tuple[Tensor, None]:
    """Drop-in for `amp_C.multi_tensor_l2norm` (total norm only), on the device, no host sync."""
    if per_tensor:
        raise NotImplementedError("per-tensor norms are not provided by foreach_l2_norm")
    (tensors,) = tensor_lists
    norms = torch._foreach_norm(tensors)
    total = torch.linalg.vector_norm(torch.stack([norm.float() for norm in norms]))
    return total.reshape(1), None


def foreach_scale(chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]], scale: float) -> None:
    """Drop-in for `amp_C.multi_tensor_scale`: dst = src * scale for each pair."""
    src, dst = tensor_lists
    if len(src) != len(dst):
        raise ValueError(f"multi_tensor_scale got {len(src)} sources and {len(dst)} destinations")
    if not src:
        return
    if all(a is b for a, b in zip(src, dst, strict=True)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, src if scale == 1.0 else torch._foreach_mul(src, scale))


def install_foreach_grad_ops() -> None:
    """Replace the local multi-tensor fallbacks used by Megatron's gradient norm and clipping.

    Why: without TE and Apex, `optimizer/clip_grads.py` binds `l2_norm_impl` to
    `utils.local_multi_tensor_l2_norm`, which builds `torch.tensor(list_of_device_norms)` (one
    device-to-host copy and sync per parameter tensor, some 300 per step for a 28-layer model),
    and `multi_tensor_scale_impl` to `local_multi_tensor_scale` (`dst.copy_(src * scale)`: a
    temporary per tensor). Only the fallbacks are replaced; TE's or Apex's kernels are kept.
    """
    if "grad_ops" in _installed:
        return
    import megatron.core.optimizer.clip_grads as clip_grads
    from megatron.core import utils

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
    if clip_grads.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
        clip_grads.multi_tensor_scale_impl = foreach_scale
    _installed.add("grad_ops")


def use_fused_adamw(optimizer: Any) -> int:
    """Switch the torch AdamW/Adam inside a Megatron optimizer to torch's fused kernel.

    Why: `optimizer/__init__.py` (`_get_megatron_optimizer_based_on_param_groups`) builds
    `torch.optim.AdamW(params, lr, weight_decay, betas, eps, capturable)` when TE and Apex are
    absent, never passing `fused`, so torch chooses its foreach implementation. Torch reads the
    `fused` / `foreach` flags of each param group at every step, so setting them before the first
    step selects the fused kernel; its step counters then live on the device, as fused requires.
    Returns the number of param groups switched; optimizers other than torch Adam/AdamW (TE's
    or Apex's FusedAdam) are left alone.
    """
    from megatron.core.optimizer import ChainedOptimizer

    parts = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    switched = 0
    for part in parts:
        inner = part.optimizer
        if type(inner) not in (torch.optim.AdamW, torch.optim.Adam):
            continue
        if any(inner.state.values()):
            raise RuntimeError("use_fused_adamw must run before the first optimizer step")
        inner.defaults.update(fused=True, foreach=False)
        for group in inner.param_groups:
            group["fused"] = True
            group["foreach"] = False
            switched += 1
    return switched


def batch_first_logits(model: Any) -> None:
    """Run a GPTModel's output layer batch-first, so that its final transpose copies nothing.

    Why: `models/gpt/gpt_model.py` `_postprocess` returns `logits.transpose(0, 1).contiguous()`
    ([s, b, V] -> [b, s, V]). With b > 1 that copies the whole logits tensor in the forward pass,
    and the backward copies its gradient twice more (it reaches the output layer non-contiguous,
    and `ColumnParallelLinear` makes it contiguous for its two GEMMs): 5 GB each time for 16k
    tokens of a 152k vocabulary, about 25 ms per training step on an H200. Forward hooks on
    `model.output_layer` hand it the hidden states as [b, s, h] (a 64 MB copy at that size) and
    return its [b, s, V] logits as an [s, b, V] view, so Megatron's transpose gives back a
    contiguous tensor. Values are unchanged; sequence parallelism (a gather over dim 0 in the
    output layer) is refused.
    """
    if model.config.sequence_parallel:
        raise NotImplementedError("batch_first_logits does not support sequence parallelism")
    layer = model.output_layer

    def batch_first_input(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden, *rest = args
        return (hidden.transpose(0, 1).contiguous(), *rest), kwargs  # [s, b, h] -> [b, s, h]

    def sequence_first_view(module: Any, args: tuple, kwargs: dict, output: tuple) -> tuple:
        logits, bias = output
        return logits.transpose(0, 1), bias  # a view [s, b, V] of [b, s, V] memory

    layer.register_forward_pre_hook(batch_first_input, with_kwargs=True)
    layer.register_forward_hook(sequence_first_view, with_kwargs=True)


def wgrad_gemm_accum(total_input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    """main_grad += grad_output^T @ total_input in one GEMM that accumulates in main_grad's dtype.

    The contract of `fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32/fp16` (Apex): inputs
    [N, in] and [N, out], main_grad [out, in]. bf16/fp16 products into an fp32 main_grad use
    torch's `addmm(..., out_dtype=float32)` (CUDA) with the output aliased to main_grad.
    """
    if main_grad.dtype == grad_output.dtype:
        main_grad.addmm_(grad_output.t(), total_input)
    else:
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=main_grad.dtype, out=main_grad)


def install_wgrad_accumulation_fusion() -> None:
    """Give Megatron's `gradient_accumulation_fusion` a kernel without Apex.

    Why: `tensor_parallel/layers.py` imports Apex's `fused_weight_gradient_mlp_cuda` and, without
    it, refuses `gradient_accumulation_fusion=True` (`_grad_accum_fusion_available`). Unfused, every
    linear layer's weight gradient is written in bf16 and then added into the fp32 `main_grad`
    buffer by a DDP hook (one more pass over all gradients, ~8 ms per step at 1.7B parameters).
    The fused path (LinearWithGradAccumulationAndAsyncCommunication.backward) calls
    `wgrad_gemm_accum_fp32(total_input, grad_output, weight.main_grad)` instead; `wgrad_gemm_accum`
    does that in one cuBLAS GEMM with beta = 1.
    """
    if "wgrad" in _installed:
        return
    import types

    from megatron.core.tensor_parallel import layers

    if layers._grad_accum_fusion_available:
        logger.info("Megatron's gradient accumulation fusion kernel is present; keeping it")
    else:
        layers.fused_weight_gradient_mlp_cuda = types.SimpleNamespace(
            wgrad_gemm_accum_fp32=wgrad_gemm_accum, wgrad_gemm_accum_fp16=wgrad_gemm_accum
        )
        layers._grad_accum_fusion_available = True
    _installed.add("wgrad")


def enable_fused_kernels() -> None:
    """Apply the module-level replacements (RoPE, gradient norm/scale, weight-gradient
    accumulation); call before building the model. `tasks.megatron.model.build_gpt_model` also
    swaps in `CompiledRMSNorm` and applies `batch_first_logits`; the trainer applies
    `use_fused_adamw` to its optimizer."""
    from megatron.core import __version__

    if __version__ not in MADE_FOR:
        logger.warning("megatron-core %s: the fused kernels were made for %s", __version__, MADE_FOR)
    install_rope_fusion()
    install_foreach_grad_ops()
    install_wgrad_accumulation_fusion()
