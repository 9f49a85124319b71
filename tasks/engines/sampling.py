"""One decode step's draw and what the embedded engine records of it.

Both decode loops of the embedded engine use these: the eager loop (`tasks.engines.embedded`, the
CPU's, and a GPU's with `decode="eager"`), whose step is a Python integer, and the captured loop
(`tasks.engines.graph_decode`), whose step is a device tensor [1] advanced inside the graph. The
indexing below reads the same with either. Both loops also share when they look at how many rows
still decode and when the stopped ones leave (`GPU_STOP_CHECK_EVERY`, `DROP_FINISHED_AT`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DROP_FINISHED_AT", "GPU_STOP_CHECK_EVERY", "DecodeOutputs", "DrawSettings", "draw", "sample_step"]

# decode steps between reads of how many rows still decode, on a GPU (each read waits for the device)
GPU_STOP_CHECK_EVERY = 16
# a decode drops its stopped rows once at most this share of its rows is still live: each drop copies
# the KV cache's filled prefix, and the rows kept run every step after it
DROP_FINISHED_AT = 7 / 8


@dataclass(frozen=True)
class DecodeOutputs:
    """A batch's decode outputs, written in place step by step (row = the batch row, column = step).

    Allocated once per batch: small per-step tensors kept alive between each step's large
    temporaries fragment the heap (on the CPU a 512 x 256 call then held up to ~2 MB more per decode
    step, varying run to run), and a captured step needs fixed addresses.
    """

    tokens: torch.Tensor  # [B, S] long
    sampled: torch.Tensor  # [B, S] float32: the log-prob of the sampled token
    topk_ids: torch.Tensor  # [B, S, K] int32
    topk_logprobs: torch.Tensor  # [B, S, K] float32
    num_tokens: torch.Tensor  # [B] long; a row's active steps form a prefix

    @classmethod
    def allocate(cls, batch: int, steps: int, top_k: int, device: torch.device) -> DecodeOutputs:
        return cls(
            tokens=torch.zeros((batch, steps), dtype=torch.long, device=device),
            sampled=torch.zeros((batch, steps), dtype=torch.float32, device=device),
            topk_ids=torch.zeros((batch, steps, top_k), dtype=torch.int32, device=device),
            topk_logprobs=torch.zeros((batch, steps, top_k), dtype=torch.float32, device=device),
            num_tokens=torch.zeros(batch, dtype=torch.long, device=device),
        )


@dataclass(frozen=True)
class DrawSettings:
    """How a batch draws its tokens: the same for every step of its decode."""

    uniforms: torch.Tensor | None  # [B, S] each batch row's draws, on the device; None: greedy
    temperature: float
    top_p: float
    stop_ids: torch.Tensor  # [n] ids that end an answer


def sample_step(
    logits: torch.Tensor,
    *,
    rows: torch.Tensor,
    step: int | torch.Tensor,
    finished: torch.Tensor,
    settings: DrawSettings,
    out: DecodeOutputs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw decoding row i's token from `logits` [b, V] and record it in batch row `rows[i]` at
    `step` (an int, or a device tensor [1]), with the top-K that `out` holds room for. Returns
    (token [b], finished [b] after this token).

    Rows already finished still draw and write (their columns past the stop are never read) but no
    longer count tokens. On a GPU without top-p the draw and the log-probs come from two passes
    over the logits in their own dtype (`tasks.engines.draw_kernel`) and the top-K from the logits
    (log-probs are logits - logsumexp); elsewhere from a float32 log-softmax.
    """
    u = None if settings.uniforms is None else settings.uniforms[rows, step]  # [b]
    k = out.topk_ids.shape[-1]
    if logits.is_cuda and settings.top_p >= 1.0:
        from tasks.engines.draw_kernel import fused_draw

        token, lse = fused_draw(logits, None if u is None else u.float(), temperature=settings.temperature)
        if token is None:
            token = logits.argmax(dim=-1)
        topk_logits, topk_ids = logits.topk(k, dim=-1)  # [b, K]
        sampled = logits.gather(-1, token[:, None])[:, 0].float() - lse
        topk_lp = topk_logits.float() - lse[:, None]
    else:
        logprobs = torch.log_softmax(logits, dim=-1)  # [b, V]
        if u is None:
            token = logprobs.argmax(dim=-1)
        else:
            # x / 1.0 is x: the common temperature skips a pass over [b, V]
            scaled = logits if settings.temperature == 1.0 else logits / settings.temperature
            token = draw(scaled, top_p=settings.top_p, u=u)
        topk_lp, topk_ids = logprobs.topk(k, dim=-1)  # [b, K]
        sampled = logprobs.gather(-1, token[:, None])[:, 0]
    out.tokens[rows, step] = token
    out.sampled[rows, step] = sampled
    out.topk_ids[rows, step] = topk_ids.to(torch.int32)
    out.topk_logprobs[rows, step] = topk_lp
    out.num_tokens[rows] += ~finished
    return token, finished | torch.isin(token, settings.stop_ids)


def draw(scaled_logits: torch.Tensor, *, top_p: float, u: torch.Tensor) -> torch.Tensor:
    """Draw one id per row by inverting the (top-p truncated) CDF at the given uniforms.

    scaled_logits: [B, V] (already divided by the temperature); u: [B] in [0, 1). Returns [B] ids.
    Without top-p the CDF is taken in vocabulary order (no sort: sorting the vocabulary was half of
    a decode step on the CPU); with top-p it is taken in descending probability, which the nucleus
    needs. Either way the draw is exact and a function of the logits and `u` alone.
    """
    probs = torch.softmax(scaled_logits, dim=-1)  # [B, V]
    if top_p >= 1.0:
        cdf = probs.cumsum(dim=-1)  # [B, V], non-decreasing
        target = u.to(cdf.dtype)[:, None] * cdf[:, -1:]
        # the first id whose CDF reaches the target; it has mass, since the CDF rises there
        return torch.searchsorted(cdf, target).clamp(max=probs.shape[-1] - 1)[:, 0]
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
    # keep the smallest prefix whose mass reaches top_p (the most likely token always stays)
    keep = (sorted_probs.cumsum(dim=-1) - sorted_probs) < top_p
    sorted_probs = sorted_probs * keep
    cdf = sorted_probs.cumsum(dim=-1)  # [B, V]
    target = u.to(cdf.dtype)[:, None] * cdf[:, -1:]
    choice = (cdf < target).sum(dim=-1)
    # round-off can push `target` past the last kept entry; clamp to the last token with mass
    last_kept = (sorted_probs > 0).sum(dim=-1) - 1
    choice = torch.minimum(choice, last_kept)
    return sorted_ids.gather(-1, choice[:, None])[:, 0]
