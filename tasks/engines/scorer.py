"""Teacher prefill: score given response tokens under a (privileged) prompt, forward only.

For each sequence `prompt_ids + response_ids`, the hidden state at position len(prompt)-1+t
predicts response token t. The log-probs there are gathered at the student's top-K ids and at the
response token itself, and the entropy of the whole next-token distribution (all V logits) is
taken there. The response is never re-tokenised: the ids the student sampled are the ids scored.

Memory: the decoder runs on a right-padded batch of at most `batch_tokens` (padded) tokens, but the
vocabulary projection runs only on the batch's response positions, gathered across its sequences
and projected `logit_chunk_tokens` rows at a time, so the largest logits tensor is
[logit_chunk_tokens, V], never [batch, T, V].

Given the student's prompt instead of the teacher's, the same function recomputes the student's
own log-probs (the rollout engine's numbers, up to float round-off).

Assumes logits = output_embeddings(decoder(...).last_hidden_state), which holds for the Llama and
Qwen families (no logit soft-capping or scaling after the projection).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import numpy as np
import torch

__all__ = ["TeacherScores", "pack_batches", "score_teacher"]

logger = logging.getLogger(__name__)


class TeacherScores(NamedTuple):
    """Log-probs for one sequence; T = len(response_ids), K = the student's top-K width."""

    topk_logprobs: np.ndarray  # [T, K] float32
    sampled_logprobs: np.ndarray  # [T] float32
    entropy: np.ndarray  # [T] float32, entropy of the next-token distribution over the full vocabulary (nats)


def pack_batches(lengths: list[int], *, batch_tokens: int) -> list[list[int]]:
    """Group sequence indices into batches whose padded size (rows x longest) fits `batch_tokens`.

    Sequences are taken longest first, which keeps padding low. A sequence longer than
    `batch_tokens` on its own gets a batch of one.
    """
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def check_scoring_inputs(
    sequences: list[tuple[list[int], list[int]]],
    topk_ids: list[np.ndarray],
    *,
    logit_chunk_tokens: int,
    vocab_size: int,
) -> int:
    """Validate a scoring request (shared by every teacher-scorer backend); returns K.

    Each prompt must be non-empty (the first response token needs a prefix), each `topk_ids[i]`
    must be [len(response_i), K] with one K for all sequences, and every id inside the vocabulary.
    """
    if len(sequences) != len(topk_ids):
        raise ValueError(f"{len(sequences)} sequences but {len(topk_ids)} top-K id arrays")
    if logit_chunk_tokens < 1:
        raise ValueError(f"logit_chunk_tokens must be >= 1, got {logit_chunk_tokens}")
    widths = {ids.shape[1] for ids in topk_ids if ids.ndim == 2}
    for i, ((prompt, response), ids) in enumerate(zip(sequences, topk_ids, strict=True)):
        if len(prompt) == 0:
            raise ValueError(f"sequence {i}: the prompt is empty; the first response token needs a prefix")
        if ids.ndim != 2 or ids.shape[0] != len(response):
            raise ValueError(
                f"sequence {i}: topk_ids has shape {ids.shape}, expected ({len(response)}, K) "
                "(one row per response token)"
            )
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"sequence {i}: topk_ids outside [0, {vocab_size}): min {ids.min()}, max {ids.max()}")
    if len(widths) > 1:
        raise ValueError(f"top-K widths differ between sequences: {sorted(widths)}")
    return widths.pop() if widths else 0


@torch.no_grad()
def score_teacher(
    model: Any,
    *,
    sequences: list[tuple[list[int], list[int]]],
    topk_ids: list[np.ndarray],
    batch_tokens: int,
    logit_chunk_tokens: int = 1024,
    reference_model: Any | None = None,
    trust_region_rate: float | None = None,
    progress: bool = False,
) -> list[TeacherScores]:
    """Log-probs of each (prompt_ids, response_ids) pair's response, at `topk_ids` and the sampled ids,
    and the entropy of each response position's next-token distribution.

    `topk_ids[i]` is [T_i, K] (the student's ids per response token). With `reference_model` and
    `trust_region_rate` tau, the teacher's logits are the trust-region mix
    (1 - tau) * z_reference + tau * z_model, both computed on the same sequence.
    Results come back in input order.
    """
    from tqdm.auto import tqdm

    from sdpo_core.teacher_update import trust_region_logits
    from tasks.progress_bars import bar_disabled

    if (reference_model is None) != (trust_region_rate is None):
        raise ValueError(
            "reference_model and trust_region_rate go together; got "
            f"reference_model={'set' if reference_model is not None else None}, {trust_region_rate=}"
        )
    check_scoring_inputs(
        sequences,
        topk_ids,
        logit_chunk_tokens=logit_chunk_tokens,
        vocab_size=model.get_output_embeddings().weight.shape[0],
    )

    device = next(model.parameters()).device
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    if reference_model is not None:
        ref_decoder, ref_head = reference_model.get_decoder(), reference_model.get_output_embeddings()

    lengths = [len(p) + len(r) for p, r in sequences]
    results: list[TeacherScores | None] = [None] * len(sequences)
    for batch in tqdm(pack_batches(lengths, batch_tokens=batch_tokens), desc="teacher", disable=bar_disabled(progress)):
        width = max(lengths[i] for i in batch)
        input_ids = torch.zeros((len(batch), width), dtype=torch.long, device=device)  # [B, L], right-padded
        for row, i in enumerate(batch):
            prompt, response = sequences[i]
            input_ids[row, : lengths[i]] = torch.tensor(prompt + response, device=device)
        # No padding mask: the padding follows each sequence, so under the causal mask no scored
        # position sees it, and the positions count from 0 either way. Without a mask, attention
        # runs as SDPA's causal kernel with grouped KV heads; with one, transformers builds a
        # [B, 1, L, L] mask and repeats K and V to every query head first.
        hidden = decoder(input_ids=input_ids).last_hidden_state  # [B, L, H]
        if reference_model is not None:
            ref_hidden = ref_decoder(input_ids=input_ids).last_hidden_state

        # Every response position of the batch, flattened: one projection per chunk of
        # `logit_chunk_tokens` positions across sequences instead of one per sequence.
        bounds = np.cumsum([0, *(len(sequences[i][1]) for i in batch)])  # each sequence's span of the N positions
        flat = torch.from_numpy(
            np.concatenate(
                [np.arange(len(sequences[i][0]) - 1, lengths[i] - 1) + row * width for row, i in enumerate(batch)]
            )
        ).to(device)  # [N]
        # The token each scored position predicts, read back from the sequence itself: it must be
        # the student's response, or the positions are misaligned.
        targets = input_ids.reshape(-1)[flat + 1]  # [N]
        expected = torch.tensor([t for i in batch for t in sequences[i][1]], dtype=torch.long, device=device)
        if not torch.equal(targets, expected):
            first = int((targets != expected).nonzero()[0, 0])
            j = int(np.searchsorted(bounds, first, side="right")) - 1
            raise AssertionError(
                f"sequence {batch[j]}: the tail of the scored sequence "
                f"{targets[bounds[j] : bounds[j + 1]].tolist()} differs from the student's response ids "
                f"{list(sequences[batch[j]][1])}"
            )
        ids = torch.from_numpy(np.concatenate([np.asarray(topk_ids[i], dtype=np.int64) for i in batch])).to(device)
        states = hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat)  # [N, H]
        if reference_model is not None:
            ref_states = ref_hidden.reshape(-1, ref_hidden.shape[-1]).index_select(0, flat)
        topk_parts, sampled_parts, entropy_parts = [], [], []
        for c0 in range(0, flat.shape[0], logit_chunk_tokens):
            c1 = min(c0 + logit_chunk_tokens, flat.shape[0])
            logits = head(states[c0:c1]).float()  # [C, V]
            if reference_model is not None:
                ref_logits = ref_head(ref_states[c0:c1]).float()
                logits = trust_region_logits(ref_logits, logits, rate=trust_region_rate)
            # one fused pass over [C, V]; logits.gather - logsumexp made three with two temporaries
            logprobs = torch.log_softmax(logits, dim=-1)  # [C, V]
            topk_parts.append(logprobs.gather(-1, ids[c0:c1]))  # [C, K]
            sampled_parts.append(logprobs.gather(-1, targets[c0:c1, None])[:, 0])  # [C]
            entropy_parts.append(-(logprobs.exp() * logprobs).sum(dim=-1))  # [C]
        k = topk_ids[batch[0]].shape[1]
        topk_all = torch.cat(topk_parts).cpu().numpy() if topk_parts else np.zeros((0, k), dtype=np.float32)
        sampled_all = torch.cat(sampled_parts).cpu().numpy() if sampled_parts else np.zeros((0,), dtype=np.float32)
        entropy_all = torch.cat(entropy_parts).cpu().numpy() if entropy_parts else np.zeros((0,), dtype=np.float32)
        for j, i in enumerate(batch):
            results[i] = TeacherScores(
                topk_logprobs=np.ascontiguousarray(topk_all[bounds[j] : bounds[j + 1]], dtype=np.float32),
                sampled_logprobs=np.ascontiguousarray(sampled_all[bounds[j] : bounds[j + 1]], dtype=np.float32),
                entropy=np.ascontiguousarray(entropy_all[bounds[j] : bounds[j + 1]], dtype=np.float32),
            )
    return results
