"""Sequence packing: variable-length samples laid end to end in token-budget micro-batches.

A padded micro-batch [B, S] spends compute on S - n_b padding tokens per row, and RL responses
vary a lot in length. Packing instead concatenates whole samples (prompt + response) into one row
per micro-batch, up to `capacity` tokens:

- `plan_packs` groups sample indices first-fit decreasing, so every micro-batch but the ones that
  close the plan is nearly full; no sample is split (attention needs its whole prefix), and a
  sample longer than the capacity gets a micro-batch of its own.
- `pack_sequences` builds one packed row. Its only padding is the optional alignment to
  `pad_to_multiple` tokens at the end, as a segment of its own.

Attention must not cross samples: the row goes to Megatron in its packed ("thd") format with the
sample boundaries in `cu_seqlens`, where the rotary embedding restarts positions at every
boundary and `tasks.megatron.attention.SDPACoreAttention` attends within each sample only, so a
packed forward equals the per-sample forwards. The index maps (`response_rows`,
`response_sample`, `response_index`, and `logit_rows` per sample) say which packed position's
logits predict response token t of sample b: position start_b + len(prompt_b) - 1 + t.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["PackedMicroBatch", "plan_packs", "pack_sequences"]


def plan_packs(lengths: Sequence[int], *, capacity: int) -> list[list[int]]:
    """Group indices into packs of at most `capacity` tokens (first-fit decreasing, stable order).

    Within a pack, indices keep their decreasing-length order. A length above the capacity gets a
    pack of its own.
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    packs: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = int(lengths[i])
        if n < 0:
            raise ValueError(f"sample {i} has negative length {n}")
        slot = next((j for j, free in enumerate(room) if free >= n), None)
        if slot is None:
            packs.append([i])
            room.append(capacity - n)
        else:
            packs[slot].append(i)
            room[slot] -= n
    return packs


@dataclass(frozen=True)
class PackedMicroBatch:
    """One packed row of B samples, L tokens; N response tokens in all, T the longest response."""

    tokens: Tensor  # [1, L] int64
    position_ids: Tensor  # [1, L] position of each token inside its own sample
    sample_ids: Tensor  # [L] int64 packed sample b of each token; -1 on alignment padding
    cu_seqlens: Tensor  # [segments + 1] int32, CPU: sample boundaries (+ the padding segment)
    max_seqlen: int
    response_rows: Tensor  # [N] packed position whose logits predict each response token
    response_sample: Tensor  # [N] the sample b of each response token
    response_index: Tensor  # [N] the position t inside that sample's response
    logit_rows: Tensor  # [B, T] response_rows per sample; 0 past the end of a response

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[1])

    def packed_seq_params(self) -> Any:
        """Megatron's `PackedSeqParams` for this row (thd format, boundaries on the CPU)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )


def pack_sequences(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    *,
    pad_to_multiple: int = 1,
    pad_id: int = 0,
) -> PackedMicroBatch:
    """Lay `prompt_b + response_b` end to end for every b, in the given order (see the module doc)."""
    if len(prompts) != len(responses) or not prompts:
        raise ValueError(f"need as many prompts as responses, at least one; got {len(prompts)} and {len(responses)}")
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    pieces, positions, owners, bounds = [], [], [], [0]
    rows, samples, index = [], [], []
    longest = max(1, max(len(r) for r in responses))
    logit_rows = np.zeros((len(prompts), longest), dtype=np.int64)
    for b, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        if len(prompt) == 0:
            raise ValueError(f"sample {b}: empty prompt; the first response token needs a prefix")
        seq = np.concatenate([np.asarray(prompt, dtype=np.int64), np.asarray(response, dtype=np.int64)])
        start = bounds[-1]
        n_r = len(response)
        scored = start + len(prompt) - 1 + np.arange(n_r, dtype=np.int64)
        pieces.append(seq)
        positions.append(np.arange(len(seq), dtype=np.int64))
        owners.append(np.full(len(seq), b, dtype=np.int64))
        bounds.append(start + len(seq))
        rows.append(scored)
        samples.append(np.full(n_r, b, dtype=np.int64))
        index.append(np.arange(n_r, dtype=np.int64))
        logit_rows[b, :n_r] = scored
    pad = -bounds[-1] % pad_to_multiple
    if pad:
        pieces.append(np.full(pad, pad_id, dtype=np.int64))
        positions.append(np.arange(pad, dtype=np.int64))
        owners.append(np.full(pad, -1, dtype=np.int64))
        bounds.append(bounds[-1] + pad)
    segments = np.diff(bounds)
    return PackedMicroBatch(
        tokens=torch.from_numpy(np.concatenate(pieces))[None],
        position_ids=torch.from_numpy(np.concatenate(positions))[None],
        sample_ids=torch.from_numpy(np.concatenate(owners)),
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
        max_seqlen=int(segments.max()),
        response_rows=torch.from_numpy(np.concatenate(rows)),
        response_sample=torch.from_numpy(np.concatenate(samples)),
        response_index=torch.from_numpy(np.concatenate(index)),
        logit_rows=torch.from_numpy(logit_rows),
    )
