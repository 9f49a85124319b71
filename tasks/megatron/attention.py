"""Core attention on torch's `scaled_dot_product_attention`, for Megatron's local layer spec.

Without Transformer Engine the local spec always builds Megatron's `DotProductAttention`
(`attention_backend` only sets TE environment variables): explicit [b*h, s, s] scores, an fp32
softmax and a causal mask tensor. `SDPACoreAttention` takes its place in
`spec.submodules.self_attention.submodules.core_attention` (see `tasks.megatron.model`) and calls
SDPA instead: on a GPU the cuDNN or flash kernels (never the s x s scores), on the CPU torch's
own kernels, which the CPU tests use. Grouped-query attention goes to SDPA as is
(`enable_gqa=True`), without repeating K and V.

Inputs and output follow `DotProductAttention`:

- padded batches (`packed_seq_params=None`): q [s, b, h, d], k/v [s, b, g, d] -> [s, b, h*d].
  Without a mask the attention is causal; an explicit Megatron mask (True = masked out,
  broadcastable to [b, 1, s, s]) is used as given.
- packed batches (`packed_seq_params.qkv_format == "thd"`): Megatron drops the batch axis, so q is
  [t, h, d] for all the samples of one micro-batch laid end to end, with their boundaries in
  `cu_seqlens_q`. Attention must not cross those boundaries: on a GPU one call of torch's
  variable-length flash attention (`torch.nn.attention.varlen.varlen_attn`, torch >= 2.10) covers
  the row, causal within each sample; on the CPU one SDPA call attends the row's samples as a batch,
  padded to the longest (`_padded_batch`). No [t, t] mask is built. Megatron's rotary embedding
  restarts positions at every boundary in this format, so a packed forward equals the per-sample
  forwards. Keep `cu_seqlens_q` on the CPU: the
  boundaries are read as Python ints.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["SDPACoreAttention", "CUDA_BACKENDS"]

# Tried in this order on a GPU: cuDNN was ~1.9x faster than flash (FA2) on an H200 at 4 x 4096;
# the memory-efficient kernel cannot take enable_gqa; math is the last resort.
CUDA_BACKENDS = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]
# Packed rows on a GPU use varlen flash attention: on an H200 (1.7B attention shape, bf16) it took
# 1.7 ms forward + backward for 42 samples of ~390 tokens, against 18-21 ms for a loop of per-sample
# SDPA calls, and 4.1 ms for 4 samples of 4096 (cuDNN loop: 3.9 ms), with the same gradient
# error as flash (benchmarks/gpu/packed_attention.py).


@functools.cache
def _varlen_kwargs() -> dict[str, Any]:
    """Causal, grouped-query keyword arguments for this torch's `varlen_attn`: torch 2.10/2.11 take
    K/V with fewer heads as they are, 2.12+ ask for `enable_gqa=True`."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kwargs: dict[str, Any] = {"window_size": (-1, 0)}  # causal: no key after the query
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return kwargs


class SDPACoreAttention(MegatronModule):
    """Drop-in for Megatron's `DotProductAttention` that runs torch SDPA (see the module docstring)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any | None = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise NotImplementedError(
                f"context_parallel_size={config.context_parallel_size}; SDPA core attention needs 1"
            )
        if attention_type != "self":
            raise NotImplementedError(f"attention_type={attention_type!r}; only self-attention is supported")
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool) -> Tensor:
        """[..., h, s, d] x [..., g, s, d] -> [..., h, s, d]."""
        kwargs = dict(
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal,
            scale=self.scale,
            enable_gqa=q.shape[-3] != k.shape[-3],
        )
        if q.is_cuda:
            with sdpa_kernel(CUDA_BACKENDS, set_priority=True):
                return F.scaled_dot_product_attention(q, k, v, **kwargs)
        return F.scaled_dot_product_attention(q, k, v, **kwargs)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by SDPACoreAttention")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type == AttnMaskType.causal
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params, causal=causal)
        s, b, h, d = query.shape
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, h|g, s, d]
        mask = None if attention_mask is None else ~attention_mask  # SDPA: True = attend
        out = self._sdpa(q, k, v, mask=mask, causal=causal and mask is None)  # [b, h, s, d]
        return out.permute(2, 0, 1, 3).reshape(s, b, h * d)

    def _packed(self, query: Tensor, key: Tensor, value: Tensor, params: PackedSeqParams, *, causal: bool) -> Tensor:
        if params.qkv_format != "thd":
            raise NotImplementedError(f"packed qkv_format={params.qkv_format!r}; only 'thd' is supported")
        if params.cu_seqlens_q_padded is not None or params.cu_seqlens_kv_padded is not None:
            raise NotImplementedError("padded cu_seqlens are not supported; pad with a segment of its own")
        if query.ndim != 3:
            raise ValueError(f"packed ('thd') query must be [t, h, d], got {tuple(query.shape)}")
        t, h, d = query.shape
        bounds = params.cu_seqlens_q.tolist()
        if bounds[0] != 0 or bounds[-1] != t or params.cu_seqlens_kv.tolist() != bounds:
            raise ValueError(f"cu_seqlens {bounds} do not cover the {t} packed tokens (or q and kv differ)")
        if not causal:
            raise NotImplementedError("packed rows are attended causally only")
        if query.is_cuda:
            return self._varlen(query, key, value, bounds)
        return self._padded_batch(query, key, value, bounds)

    def _padded_batch(self, query: Tensor, key: Tensor, value: Tensor, bounds: list[int]) -> Tensor:
        """The packed row [t, h|g, d] as one SDPA call over its samples padded to the longest: [t, h*d].

        Sample b's tokens go to row b, left-aligned; a padding slot reads an all-zero extra token.
        Causal attention keeps every real query on its own sample's real keys (the padding lies
        after them), the padded queries' outputs are dropped, so their gradient is zero. One call
        instead of a loop of per-sample calls, whose slices each cost a full-row gradient buffer in
        the backward pass (on a CPU step of 512 answers of 256 tokens the attention's operator time
        fell from 1.7 to 1.2 s; the step's wall time did not measurably change, docs/changelog.md).
        """
        t, h, d = query.shape
        starts = torch.tensor(bounds[:-1])
        lengths = torch.tensor(bounds[1:]) - starts  # [B]
        slots = torch.arange(int(lengths.max()))  # [L]
        real = slots[None, :] < lengths[:, None]  # [B, L]
        index = torch.where(real, starts[:, None] + slots[None, :], t)  # [B, L]; t = the zero token

        def batch(x: Tensor) -> Tensor:  # [t, h|g, d] -> [B, h|g, L, d]
            padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
            return padded[index].transpose(1, 2)

        out = self._sdpa(batch(query), batch(key), batch(value), mask=None, causal=True)  # [B, h, L, d]
        return out.transpose(1, 2)[real].reshape(t, h * d)  # samples in order: the packed order

    def _varlen(self, query: Tensor, key: Tensor, value: Tensor, bounds: list[int]) -> Tensor:
        """One causal variable-length flash-attention call over the packed row [t, h|g, d] -> [t, h*d]."""
        from torch.nn.attention.varlen import varlen_attn

        if self.training and self.dropout > 0:
            raise NotImplementedError("attention dropout is not supported on packed rows")
        t, h, d = query.shape
        cu = torch.tensor(bounds, dtype=torch.int32).to(query.device, non_blocking=True)
        longest = max(z - a for a, z in zip(bounds[:-1], bounds[1:], strict=True))
        out = varlen_attn(query, key, value, cu, cu, longest, longest, scale=self.scale, **_varlen_kwargs())
        return out.reshape(t, h * d)
