"""The policy loss the trainer applies: SDPO, GRPO, or their blend, with masks and reductions.

The trainer is algorithm-blind: it fills a `LossInputs` from the shards and its own forward pass and
calls `policy_loss` with flat hyperparameters. Everything the algorithm decides upstream (rewards,
advantages, the per-sample self-distillation mask, the teacher's log-probabilities) arrives as
tensors.

Shapes: B samples, T response positions (right-padded, `response_mask` marks real tokens), K top-K
ids, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from sdpo_core.divergence import (
    full_vocab_divergence,
    sampled_token_loss,
    topk_divergence,
)
from sdpo_core.grpo import LOG_RATIO_CLAMP, ppo_clip_loss, ppo_clipped_mask

Reduction = Literal["exclude", "dilute"]
Aggregation = Literal["token-mean", "sequence-mean"]
LossType = Literal["sdpo", "grpo", "blend"]
Divergence = Literal["topk_tail", "topk_renorm", "full", "sampled_token"]

_REDUCTIONS = ("exclude", "dilute")
_AGGREGATIONS = ("token-mean", "sequence-mean")
_LOSS_TYPES = ("sdpo", "grpo", "blend")
_DIVERGENCES = ("topk_tail", "topk_renorm", "full", "sampled_token")


def importance_weights(logprobs: Tensor, old_logprobs: Tensor, *, clip: float | None) -> Tensor:
    """Per-token off-policy weights min(exp(sg(logprobs - old_logprobs)), clip): [B, T] -> [B, T].

    The log-ratio is clamped to [-20, 20] before exp. The weights carry no gradient: they reweight
    the distillation term, they are not part of what is optimised. `clip=None` turns the
    correction off (all ones).
    """
    if logprobs.shape != old_logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and old_logprobs {tuple(old_logprobs.shape)} differ in shape"
        )
    if clip is None:
        return torch.ones_like(logprobs).detach()
    if clip <= 0:
        raise ValueError(f"importance-weight clip must be > 0 or None, got {clip}")
    log_ratio = (logprobs - old_logprobs).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return log_ratio.exp().clamp(max=clip)


def _check_masks(per_token: Tensor, response_mask: Tensor, sample_mask: Tensor) -> None:
    if per_token.ndim != 2 or response_mask.shape != per_token.shape:
        raise ValueError(
            f"per_token and response_mask must share one [B, T] shape, got {tuple(per_token.shape)} "
            f"and {tuple(response_mask.shape)}"
        )
    if sample_mask.shape != per_token.shape[:1]:
        raise ValueError(f"sample_mask must be [B]={per_token.shape[0]}, got {tuple(sample_mask.shape)}")
    if response_mask.dtype != torch.bool or sample_mask.dtype != torch.bool:
        raise TypeError(f"masks must be bool, got response_mask {response_mask.dtype}, sample_mask {sample_mask.dtype}")


def _check_modes(reduction: str, aggregation: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}; expected one of {_REDUCTIONS}")
    if aggregation not in _AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r}; expected one of {_AGGREGATIONS}")


def loss_denominator(
    response_mask: Tensor, sample_mask: Tensor, *, reduction: Reduction, aggregation: Aggregation
) -> Tensor:
    """The count `masked_mean` divides by (float scalar); see `masked_mean` for the four cases.

    When one batch is split into micro-batches whose gradients are summed, compute this once on the
    whole batch's masks and pass it to every micro-batch, so the summed loss equals the whole-batch
    mean.
    """
    _check_modes(reduction, aggregation)
    active = response_mask & sample_mask[:, None]  # [B, T]
    if aggregation == "token-mean":
        counted = active if reduction == "exclude" else response_mask
        return counted.sum().to(torch.float32)
    if reduction == "exclude":
        return (active.sum(dim=1) > 0).sum().to(torch.float32)
    return torch.tensor(float(sample_mask.shape[0]))


def masked_mean(
    per_token: Tensor,
    response_mask: Tensor,
    sample_mask: Tensor,
    *,
    reduction: Reduction,
    aggregation: Aggregation,
    denominator: Tensor | float | None = None,
) -> Tensor:
    """Reduce a per-token loss [B, T] to a scalar under the response and per-sample masks.

    A token is active when `response_mask[b, t] and sample_mask[b]`; n_b = sum_t response_mask[b, t].
    With x_bt the per-token value:

    - exclude, token-mean:    sum_active x_bt / #active tokens.
    - dilute, token-mean:     sum_active x_bt / #response tokens of all samples (masked samples add
      zeros to the numerator but keep their tokens in the count).
    - exclude, sequence-mean: mean over active samples (sample_mask and n_b > 0) of
      s_b = sum_t active x_bt / n_b.
    - dilute, sequence-mean:  sum_b s_b / B, where a masked sample has s_b = 0. This is the paper's
      code with one sequence per micro-batch.

    "exclude" keeps the per-token scale fixed as the share of masked samples changes; "dilute" shrinks
    the loss (and so the effective learning rate) when few samples have a teacher. With no active
    token the loss is 0 and its gradient is exactly 0 (never NaN): masked positions are selected
    out, not multiplied by 0, and the denominator is at least 1. `denominator` overrides the count
    (see `loss_denominator`).
    """
    _check_masks(per_token, response_mask, sample_mask)
    _check_modes(reduction, aggregation)
    active = response_mask & sample_mask[:, None]  # [B, T]
    values = torch.where(active, per_token, torch.zeros_like(per_token))  # [B, T]
    if aggregation == "token-mean":
        numerator = values.sum()
    else:
        tokens_per_sample = response_mask.sum(dim=1).clamp(min=1).to(values.dtype)  # [B]
        numerator = (values.sum(dim=1) / tokens_per_sample).sum()
    if denominator is None:
        denominator = loss_denominator(response_mask, sample_mask, reduction=reduction, aggregation=aggregation)
    denominator = torch.as_tensor(denominator, dtype=numerator.dtype, device=numerator.device)
    return numerator / denominator.clamp(min=1.0)


@dataclass(frozen=True, kw_only=True)
class LossInputs:
    """Everything `policy_loss` reads, padded to [B, T] (and [B, T, K] / [B, T, V]).

    Tensors that carry the student's gradient: `student_token_logprobs`, `student_topk_logprobs`,
    `student_logits`. All others are treated as constants. Which optional fields are needed depends on
    the loss: top-K divergences need both `*_topk_logprobs`; "full" needs both `*_logits`;
    "sampled_token" needs `teacher_token_logprobs`; GRPO (and the blend) need `advantages`.
    """

    student_token_logprobs: Tensor  # [B, T] log p_theta(y_t), with grad
    old_token_logprobs: Tensor  # [B, T] behaviour policy log-prob of y_t (IS weights, PPO ratio)
    response_mask: Tensor  # [B, T] bool, real response tokens
    sample_mask: Tensor  # [B] bool, samples that have a teacher (self-distillation mask)
    student_topk_logprobs: Tensor | None = None  # [B, T, K] full-vocabulary log-probs, with grad
    teacher_topk_logprobs: Tensor | None = None  # [B, T, K] teacher log-probs at the same ids
    teacher_token_logprobs: Tensor | None = None  # [B, T] teacher log-prob of y_t
    advantages: Tensor | None = None  # [B] GRPO advantages, computed upstream
    student_logits: Tensor | None = None  # [B, T, V] for divergence="full", with grad
    teacher_logits: Tensor | None = None  # [B, T, V] for divergence="full"
    sdpo_denominator: Tensor | float | None = None  # whole-batch count for the SDPO term (micro-batching)
    grpo_denominator: Tensor | float | None = None  # whole-batch count for the GRPO term (micro-batching)

    def __post_init__(self) -> None:
        if self.student_token_logprobs.ndim != 2:
            shape = tuple(self.student_token_logprobs.shape)
            raise ValueError(f"student_token_logprobs must be [B, T], got {shape}")
        bt = tuple(self.student_token_logprobs.shape)
        per_token = {
            "old_token_logprobs": self.old_token_logprobs,
            "response_mask": self.response_mask,
            "teacher_token_logprobs": self.teacher_token_logprobs,
        }
        for name, value in per_token.items():
            if value is not None and tuple(value.shape) != bt:
                raise ValueError(f"{name} must be [B, T]={bt}, got {tuple(value.shape)}")
        for name, value in {"sample_mask": self.sample_mask, "advantages": self.advantages}.items():
            if value is not None and tuple(value.shape) != bt[:1]:
                raise ValueError(f"{name} must be [B]=({bt[0]},), got {tuple(value.shape)}")
        pairs = (
            ("topk_logprobs", self.student_topk_logprobs, self.teacher_topk_logprobs),
            ("logits", self.student_logits, self.teacher_logits),
        )
        for what, student, teacher in pairs:
            for side, value in (("student", student), ("teacher", teacher)):
                if value is not None and (value.ndim != 3 or tuple(value.shape[:2]) != bt):
                    raise ValueError(f"{side}_{what} must be [B, T, *] with [B, T]={bt}, got {tuple(value.shape)}")
            if student is not None and teacher is not None and student.shape != teacher.shape:
                raise ValueError(
                    f"student_{what} {tuple(student.shape)} and teacher_{what} {tuple(teacher.shape)} differ in shape"
                )
        if self.response_mask.dtype != torch.bool or self.sample_mask.dtype != torch.bool:
            raise TypeError(
                f"masks must be bool, got response_mask {self.response_mask.dtype}, "
                f"sample_mask {self.sample_mask.dtype}"
            )


@dataclass(frozen=True)
class LossOutputs:
    """The scalar loss to backpropagate and detached float metrics (namespaced `sdpo/`, `grpo/`, `loss/`).

    `metric_counts[name]` is how many elements (tokens or samples) the mean `metrics[name]` is taken
    over, so micro-batch metrics combine into the metric of the whole step
    (`sdpo_core.metrics.combine_metrics`); a metric without a count (the losses) is a micro-batch's share of the
    step's loss and combines by summing.
    """

    loss: Tensor
    metrics: dict[str, float]
    metric_counts: dict[str, float] = field(default_factory=dict)


def _require(fields: dict[str, Tensor | None], *, why: str) -> list[Tensor]:
    """The values of `fields` in order; raises naming every field that is None."""
    missing = [name for name, value in fields.items() if value is None]
    if missing:
        raise ValueError(f"{why} needs LossInputs fields {missing}, which are None")
    return [value for value in fields.values() if value is not None]


def _topk_logprobs(inputs: LossInputs, *, divergence: Divergence) -> tuple[Tensor, Tensor]:
    """(student, teacher) top-K logprobs [B, T, K] of a top-K divergence."""
    student, teacher = _require(
        {
            "student_topk_logprobs": inputs.student_topk_logprobs,
            "teacher_topk_logprobs": inputs.teacher_topk_logprobs,
        },
        why=f"divergence={divergence!r}",
    )
    return student, teacher


def _sdpo_per_token(inputs: LossInputs, *, divergence: Divergence, alpha: float) -> tuple[Tensor, Tensor]:
    """(per-token loss term, per-token divergence for logging), both [B, T]."""
    if divergence in ("topk_tail", "topk_renorm"):
        student_topk, teacher_topk = _topk_logprobs(inputs, divergence=divergence)
        value = topk_divergence(student_topk, teacher_topk, alpha=alpha, tail=divergence == "topk_tail")
        return value, value.detach()
    if divergence == "full":
        student_logits, teacher_logits = _require(
            {"student_logits": inputs.student_logits, "teacher_logits": inputs.teacher_logits},
            why="divergence='full'",
        )
        value = full_vocab_divergence(student_logits, teacher_logits, alpha=alpha)
        return value, value.detach()
    if alpha != 1.0:
        raise ValueError(
            f"divergence='sampled_token' estimates KL(student||teacher) and needs alpha=1, got alpha={alpha}"
        )
    (teacher_token_logprobs,) = _require(
        {"teacher_token_logprobs": inputs.teacher_token_logprobs}, why="divergence='sampled_token'"
    )
    surrogate = sampled_token_loss(inputs.student_token_logprobs, teacher_token_logprobs)
    estimate = (inputs.student_token_logprobs - teacher_token_logprobs).detach()
    return surrogate, estimate


def _masked_token_mean(values: Tensor, mask: Tensor) -> float:
    """Detached mean of `values` over `mask` as a float (0.0 when the mask is empty), for metrics."""
    count = int(mask.sum())
    return float(torch.where(mask, values.detach(), torch.zeros_like(values)).sum()) / count if count else 0.0


def _sdpo_term(
    inputs: LossInputs,
    *,
    divergence: Divergence,
    alpha: float,
    is_clip: float | None,
    reduction: Reduction,
    aggregation: Aggregation,
) -> tuple[Tensor, dict[str, float], dict[str, float]]:
    response_mask, sample_mask = inputs.response_mask, inputs.sample_mask
    per_token, divergence_value = _sdpo_per_token(inputs, divergence=divergence, alpha=alpha)  # [B, T]
    weights = importance_weights(inputs.student_token_logprobs, inputs.old_token_logprobs, clip=is_clip)
    loss = masked_mean(
        per_token * weights.to(per_token.dtype),
        response_mask,
        sample_mask,
        reduction=reduction,
        aggregation=aggregation,
        denominator=inputs.sdpo_denominator,
    )
    active = response_mask & sample_mask[:, None]  # [B, T]
    num_response = int(response_mask.sum())
    num_active = float(active.sum())
    metrics = {
        "sdpo/loss": float(loss.detach()),
        "sdpo/divergence_mean": _masked_token_mean(divergence_value, active),
        "sdpo/active_token_fraction": int(active.sum()) / num_response if num_response else 0.0,
        "sdpo/active_sample_fraction": float(sample_mask.float().mean()) if sample_mask.numel() else 0.0,
        "sdpo/is_weight_mean": _masked_token_mean(weights, active),
    }
    if is_clip is not None:
        log_ratio = (inputs.student_token_logprobs - inputs.old_token_logprobs).detach()
        metrics["sdpo/is_clip_fraction"] = _masked_token_mean((log_ratio.exp() > is_clip).float(), active)
    if divergence in ("topk_tail", "topk_renorm"):
        student_topk, teacher_topk = _topk_logprobs(inputs, divergence=divergence)
        for side, topk in (("student", student_topk), ("teacher", teacher_topk)):
            mass = torch.logsumexp(topk.detach().float(), dim=-1).exp()  # [B, T]
            metrics[f"sdpo/{side}_topk_mass_mean"] = _masked_token_mean(mass, active)
    counts = {name: num_active for name in metrics if name != "sdpo/loss"}
    counts["sdpo/active_token_fraction"] = float(num_response)
    counts["sdpo/active_sample_fraction"] = float(sample_mask.numel())
    return loss, metrics, counts


def _grpo_term(
    inputs: LossInputs,
    *,
    reduction: Reduction,
    aggregation: Aggregation,
    clip_low: float,
    clip_high: float,
) -> tuple[Tensor, dict[str, float], dict[str, float]]:
    (advantages,) = _require({"advantages": inputs.advantages}, why="the GRPO term")
    response_mask = inputs.response_mask
    ppo_args = (inputs.student_token_logprobs, inputs.old_token_logprobs, advantages, response_mask)
    per_token = ppo_clip_loss(*ppo_args, clip_low=clip_low, clip_high=clip_high)  # [B, T]
    loss = masked_mean(
        per_token,
        response_mask,
        torch.ones_like(inputs.sample_mask),
        reduction=reduction,
        aggregation=aggregation,
        denominator=inputs.grpo_denominator,
    )
    clipped = ppo_clipped_mask(*ppo_args, clip_low=clip_low, clip_high=clip_high)  # [B, T]
    log_ratio = (inputs.student_token_logprobs - inputs.old_token_logprobs).detach()
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # [B, T]
    advantages = advantages.detach().float()
    metrics = {
        "grpo/loss": float(loss.detach()),
        "grpo/clip_fraction": _masked_token_mean(clipped.float(), response_mask),
        "grpo/ratio_mean": _masked_token_mean(ratio, response_mask),
        "grpo/advantage_mean": float(advantages.mean()) if advantages.numel() else 0.0,
        "grpo/advantage_abs_mean": float(advantages.abs().mean()) if advantages.numel() else 0.0,
    }
    tokens = float(response_mask.sum())
    counts = {"grpo/clip_fraction": tokens, "grpo/ratio_mean": tokens}
    counts["grpo/advantage_mean"] = counts["grpo/advantage_abs_mean"] = float(advantages.numel())
    return loss, metrics, counts


def policy_loss(
    inputs: LossInputs,
    *,
    loss_type: LossType,
    divergence: Divergence,
    alpha: float,
    blend_lambda: float,
    is_clip: float | None,
    reduction: Reduction,
    aggregation: Aggregation,
    clip_low: float,
    clip_high: float,
) -> LossOutputs:
    """The training loss for one (micro-)batch.

    - "sdpo": L_sdpo = masked_mean(w_t * D_t) over tokens of samples with `sample_mask`, where D_t
      is the chosen per-token divergence (alpha convention in `sdpo_core.divergence`) and
      w_t = importance_weights(student, old, clip=is_clip). For "sampled_token", D_t is the REINFORCE
      surrogate of `sampled_token_loss` (alpha must be 1) and `sdpo/divergence_mean` logs
      log p - log q instead.
    - "grpo": L_grpo = masked_mean of the PPO-clip loss over all response tokens (`sample_mask` is
      ignored: every sample has an advantage).
    - "blend": blend_lambda * L_grpo + (1 - blend_lambda) * L_sdpo. `blend_lambda` is read only here.

    `reduction` and `aggregation` are as in `masked_mean`; `clip_low`/`clip_high` are read only by
    the GRPO term, `divergence`/`alpha`/`is_clip` only by the SDPO term. Only the terms the loss
    type needs are computed, so the other term's inputs may be None.
    """
    if loss_type not in _LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}; expected one of {_LOSS_TYPES}")
    if divergence not in _DIVERGENCES:
        raise ValueError(f"divergence={divergence!r}; expected one of {_DIVERGENCES}")
    if not 0.0 <= blend_lambda <= 1.0:
        raise ValueError(f"blend_lambda={blend_lambda} is outside [0, 1]")
    _check_modes(reduction, aggregation)

    metrics: dict[str, float] = {}
    counts: dict[str, float] = {}
    if loss_type in ("sdpo", "blend"):
        sdpo_loss, sdpo_metrics, sdpo_counts = _sdpo_term(
            inputs,
            divergence=divergence,
            alpha=alpha,
            is_clip=is_clip,
            reduction=reduction,
            aggregation=aggregation,
        )
        metrics.update(sdpo_metrics)
        counts.update(sdpo_counts)
    if loss_type in ("grpo", "blend"):
        grpo_loss, grpo_metrics, grpo_counts = _grpo_term(
            inputs, reduction=reduction, aggregation=aggregation, clip_low=clip_low, clip_high=clip_high
        )
        metrics.update(grpo_metrics)
        counts.update(grpo_counts)

    if loss_type == "sdpo":
        loss = sdpo_loss
    elif loss_type == "grpo":
        loss = grpo_loss
    else:
        loss = blend_lambda * grpo_loss + (1.0 - blend_lambda) * sdpo_loss
    metrics["loss/total"] = float(loss.detach())
    return LossOutputs(loss=loss, metrics=metrics, metric_counts=counts)
