"""A decode step of the embedded engine without copies: a preallocated KV cache, and on the CPU an
attention that reads it as it lies.

`preallocated_cache` gives every decoder layer buffers of the batch's final length
(`PreallocatedLayer`): a step writes its position and attends a view of the filled prefix, where
transformers' growing cache concatenates (copies) itself every step.

CPU attention: SDPA for the prompt, grouped GEMMs for a decode step.

A decode step has one query per row against the row's cached keys. Through HF's SDPA path that is
one fused-kernel call per layer on [B, h, 1, d] queries with an explicit padding mask, and, with
fewer KV heads than query heads and a mask, K and V repeated to every query head first
(`repeat_kv`, a copy of the cache per layer per step). Here the h query heads of a step are viewed
as [B, g, h / g, d] next to their group's keys [B, g, s, d]: scores, mask, softmax and the value
sum are two batched GEMMs over the cache as it lies (the embedded engine's preallocated cache
hands out strided views of its buffers, which BLAS reads without a copy; on the CPU its keys lie
transposed, so the scores GEMM reads each row's positions contiguously). The prompt's forward
(several queries per row) stays on HF's SDPA.

A captured decode step (`tasks.engines.graph_decode`, CUDA graphs) passes the column it writes and
each row's first column as device tensors (`decode_column`, `decode_start` keyword arguments of the
model's forward, which transformers hands to the cache and the attention, with `decode_end` =
column + 1): the layer then writes that column and returns its whole buffers, and the attention
reads each row's columns [start, end) (`tasks.engines.decode_attention`), so one graph serves every
step.

Registered with transformers under `ATTENTION` (an attention function and its mask function, the
SDPA boolean mask: True = attend); the engine loads its models with `attn_implementation=ATTENTION`
(on a GPU the attention is SDPA but for the captured step's).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

__all__ = ["ATTENTION", "PreallocatedLayer", "preallocated_cache", "register_decode_attention"]

ATTENTION = "sdpo_decode"


class PreallocatedLayer(DynamicLayer):
    """A layer's KV cache in buffers of a fixed capacity: `update` writes the new positions after the
    filled ones and returns views [B, g, s, d] of the filled prefix (no copy of the cache).

    Values lie [B, g, capacity, d]. Keys lie the same way, or with `keys_transposed` as
    [B, g, d, capacity]: a decode step's scores GEMM (q [g, r, d] x K^T [d, s] per row) then reads
    each row's keys with the positions contiguous. On the CPU that GEMM took 24-38 % less time at
    150-270 cached positions (512 rows, 2 KV heads of 16 dims); the returned `keys` are then a
    transposed view, which the CPU decode attention reads as it lies. SDPA (the prompt's forward,
    every step on a GPU) wants the head dimension contiguous, so GPUs keep the plain layout.
    """

    def __init__(self, capacity: int, *, keys_transposed: bool = False) -> None:
        super().__init__()
        self.capacity = capacity
        self.keys_transposed = keys_transposed
        self.filled = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, g, _, d = key_states.shape
        self.device = key_states.device
        key_shape = (b, g, d, self.capacity) if self.keys_transposed else (b, g, self.capacity, d)
        self.key_buffer = key_states.new_empty(key_shape)
        self.value_buffer = value_states.new_empty(b, value_states.shape[1], self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def _key_positions(self, start: int, end: int) -> torch.Tensor:
        """The key buffer's positions [start, end) as a [B, g, s, d] view."""
        if self.keys_transposed:
            return self.key_buffer[..., start:end].transpose(-1, -2)
        return self.key_buffer[:, :, start:end]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        column = kwargs.get("kwargs", {}).get("decode_column")
        if column is not None:
            # a captured step: the column is a device tensor [1]; `filled` is the host's to keep
            if self.keys_transposed:
                raise ValueError("a captured decode step writes the plain key layout")
            self.key_buffer.index_copy_(2, column, key_states)
            self.value_buffer.index_copy_(2, column, value_states)
            return self.key_buffer, self.value_buffer
        end = self.filled + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache of {self.capacity} positions cannot take position {end}")
        self._key_positions(self.filled, end).copy_(key_states)
        self.value_buffer[:, :, self.filled : end] = value_states
        self.filled = end
        self.keys = self._key_positions(0, end)
        self.values = self.value_buffer[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.filled

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the batch rows `indices` (a decode drops its finished rows): the filled prefix is
        copied into buffers of the same capacity, so the next steps still write in place."""
        if not self.is_initialized:
            raise RuntimeError("a KV cache layer cannot select rows before its first update")
        keys = self.key_buffer.new_empty(len(indices), *self.key_buffer.shape[1:])
        if self.keys_transposed:
            keys[..., : self.filled] = self.key_buffer[indices, ..., : self.filled]
        else:
            keys[:, :, : self.filled] = self.key_buffer[indices, :, : self.filled]
        values = self.value_buffer.new_empty(len(indices), *self.value_buffer.shape[1:])
        values[:, :, : self.filled] = self.value_buffer[indices, :, : self.filled]
        self.key_buffer, self.value_buffer = keys, values
        self.keys = self._key_positions(0, self.filled)
        self.values = self.value_buffer[:, :, : self.filled]


def preallocated_cache(config: Any, *, capacity: int, keys_transposed: bool = False) -> Cache:
    """One `PreallocatedLayer` per decoder layer; every layer must attend to the whole sequence."""
    text = config.get_text_config()
    # HF configs list `layer_types` for models whose layers differ (sliding windows, linear attention)
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ValueError(f"the embedded engine decodes full-attention layers only; this model's layer_types: {kinds}")
    return Cache(
        layers=[PreallocatedLayer(capacity, keys_transposed=keys_transposed) for _ in range(text.num_hidden_layers)]
    )


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query [B, h, q, d], key/value [B, g, s, d], mask [B, 1, q, s] (True = attend) or None ->
    ([B, q, h, d], None), as HF's attention functions return."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, h, q, d = query.shape
    start, end = kwargs.pop("decode_start", None), kwargs.pop("decode_end", None)
    kwargs.pop("decode_column", None)
    if start is not None:
        from tasks.engines.decode_attention import decode_attention

        scale = scaling if scaling is not None else d**-0.5
        return decode_attention(query, key, value, start, end, scale), None
    if q != 1 or module.training or query.device.type != "cpu":
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    g, s = key.shape[1], key.shape[2]
    if h % g:
        raise ValueError(f"{h} query heads cannot share {g} KV heads")
    scale = scaling if scaling is not None else d**-0.5
    # head i attends with KV head i // (h / g), as HF's repeat_kv lays them out
    grouped = query.reshape(b, g, h // g, d)  # [B, g, r, d]
    # scaled and masked in place: two fewer [B, g, r, s] tensors a layer a step (a sixth of the
    # attention's time at 512 rows on the CPU), the same values
    scores = torch.matmul(grouped, key.transpose(-1, -2)).mul_(scale)  # [B, g, r, s]
    if attention_mask is not None:
        scores.masked_fill_(~attention_mask.reshape(b, 1, 1, s), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(value.dtype)
    out = torch.matmul(probs, value)  # [B, g, r, d]
    return out.reshape(b, 1, h, d), None


@functools.cache
def register_decode_attention() -> str:
    """Register the attention and its mask function with transformers (once); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    return ATTENTION
