"""GRPO pieces: group-relative advantages and the PPO-clip surrogate with separate clip ranges."""

from __future__ import annotations

import torch
from torch import Tensor

# Log-ratios are clamped before exp so that a stale behaviour log-prob cannot overflow the ratio.
LOG_RATIO_CLAMP = 20.0


def group_advantages(rewards: Tensor, group_ids: Tensor, *, normalize_std: bool, eps: float = 1e-6) -> Tensor:
    """Reward minus its group's mean, optionally divided by the group's std: [N] -> [N].

    Groups are the samples sharing an integer id; ids need not be contiguous or sorted. The std is
    the unbiased one (divide by n - 1), and the division is by (std + eps). A group of one sample has
    no baseline other than itself, so its advantage is 0 (the std of a singleton is taken as 1).
    `normalize_std=False` is the Dr.GRPO form the paper's GRPO baseline uses.
    """
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must be 1-D of equal length, got {tuple(rewards.shape)} and "
            f"{tuple(group_ids.shape)}"
        )
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
        raise TypeError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if not rewards.dtype.is_floating_point:
        raise TypeError(f"rewards must be a floating tensor, got {rewards.dtype}")
    _, index = torch.unique(group_ids, return_inverse=True)  # [N] -> dense group index in [0, G)
    num_groups = int(index.max()) + 1 if index.numel() > 0 else 0
    counts = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device)
    counts.index_add_(0, index, torch.ones_like(rewards))  # [G]
    sums = torch.zeros_like(counts).index_add_(0, index, rewards)  # [G]
    centered = rewards - (sums / counts)[index]  # [N]
    if not normalize_std:
        return centered
    squares = torch.zeros_like(counts).index_add_(0, index, centered.square())  # [G]
    singleton = counts < 2
    variance = torch.where(singleton, torch.ones_like(counts), squares / (counts - 1).clamp(min=1))
    return centered / (variance.sqrt()[index] + eps)


def _check_token_shapes(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor) -> None:
    if logprobs.ndim != 2 or old_logprobs.shape != logprobs.shape or response_mask.shape != logprobs.shape:
        raise ValueError(
            f"logprobs, old_logprobs and response_mask must share one [B, T] shape, got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(response_mask.shape)}"
        )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [B]={logprobs.shape[0]}, got {tuple(advantages.shape)}")
    if response_mask.dtype != torch.bool:
        raise TypeError(f"response_mask must be bool, got {response_mask.dtype}")


def _ratio(logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return log_ratio.exp()


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    ratio_cap: float | None = None,
) -> Tensor:
    """Per-token PPO-clip loss -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A): [B, T] -> [B, T].

    r = exp(logprobs - old_logprobs) with the log-ratio clamped to [-20, 20]; `advantages` [B] is
    broadcast over the sequence. Positions outside `response_mask` are 0. A larger `clip_high` than
    `clip_low` ("clip-higher") lets low-probability tokens with positive advantage grow faster.
    With `ratio_cap` c (the dual clip), a token with A < 0 costs at most c |A|: past r = c its loss
    is flat, so a stale sample whose ratio has run away pushes no further.
    """
    _check_token_shapes(logprobs, old_logprobs, advantages, response_mask)
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip ranges must be >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    if ratio_cap is not None and ratio_cap <= 1.0 + clip_high:
        raise ValueError(f"ratio_cap={ratio_cap} must exceed 1 + clip_high = {1.0 + clip_high}")
    ratio = _ratio(logprobs, old_logprobs)  # [B, T]
    adv = advantages.detach()[:, None].to(ratio.dtype)  # [B, 1]
    unclipped = -ratio * adv
    clipped = -ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    loss = torch.maximum(unclipped, clipped)
    if ratio_cap is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -ratio_cap * adv), loss)
    return torch.where(response_mask, loss, torch.zeros_like(loss))


def ratio_capped_mask(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, *, ratio_cap: float
) -> Tensor:
    """Response tokens the dual clip flattens (A < 0 and r > ratio_cap): [B, T] bool."""
    _check_token_shapes(logprobs, old_logprobs, advantages, response_mask)
    with torch.no_grad():
        ratio = _ratio(logprobs, old_logprobs)
        return (advantages[:, None] < 0) & (ratio > ratio_cap) & response_mask


def clip_advantages(advantages: Tensor, *, running_abs_mean: float, multiple: float) -> Tensor:
    """Advantages clipped to +- `multiple` times the running mean of |A|: [N] -> [N].

    A group whose rewards sit far from its mean (one success among many failures, scored by a stale
    policy) otherwise weighs several times an ordinary group; the cap keeps any one sample within
    `multiple` typical advantages. A running mean of 0 (no signal yet) leaves them unclipped.
    """
    if multiple <= 0:
        raise ValueError(f"the advantage clip multiple must be > 0, got {multiple}")
    if running_abs_mean <= 0:
        return advantages
    limit = multiple * running_abs_mean
    return advantages.clamp(-limit, limit)


def running_abs_mean(advantages: Tensor, *, previous_sum: float, previous_count: float) -> tuple[float, float]:
    """(sum of |A|, count) over the run so far, this iteration's advantages [N] added."""
    return previous_sum + float(advantages.abs().sum()), previous_count + float(advantages.numel())


def ppo_clipped_mask(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> Tensor:
    """Response tokens whose PPO gradient the clip removes (clipped term strictly wins): [B, T] bool."""
    _check_token_shapes(logprobs, old_logprobs, advantages, response_mask)
    with torch.no_grad():
        ratio = _ratio(logprobs, old_logprobs)
        adv = advantages[:, None].to(ratio.dtype)
        clipped = -ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
        return (clipped > -ratio * adv) & response_mask
