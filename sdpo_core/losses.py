"""The policy loss the trainer applies: SDPO, GRPO, their blend, or SRPO's routing between them.

The trainer is algorithm-blind: it fills a `LossInputs` from the shards and its own forward pass and
calls `policy_loss` with flat hyperparameters. Everything the algorithm decides upstream (rewards,
advantages, the per-sample self-distillation mask, SRPO's route, the questions' pass rates, the
teacher's log-probabilities and entropies) arrives as tensors.

Shapes: B samples, T response positions (right-padded, `response_mask` marks real tokens), K top-K
ids, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import torch
from torch import Tensor

from sdpo_core.divergence import (
    full_vocab_divergence,
    sampled_token_loss,
    topk_divergence,
)
from sdpo_core.grpo import LOG_RATIO_CLAMP, ppo_clip_loss, ppo_clipped_mask, ratio_capped_mask
from sdpo_core.reductions import Aggregation, Reduction, check_modes, masked_mean, masked_token_mean
from sdpo_core.weights import entropy_weights, normalised, question_weights

LossType = Literal["sdpo", "grpo", "blend", "srpo"]
Divergence = Literal["topk_tail", "topk_renorm", "full", "sampled_token"]

_LOSS_TYPES = ("sdpo", "grpo", "blend", "srpo")
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


@dataclass(frozen=True, kw_only=True)
class LossInputs:
    """Everything `policy_loss` reads, padded to [B, T] (and [B, T, K] / [B, T, V]).

    Tensors that carry the student's gradient: `student_token_logprobs`, `student_topk_logprobs`,
    `student_logits`. All others are treated as constants. Which optional fields are needed depends on
    the loss: top-K divergences need both `*_topk_logprobs`; "full" needs both `*_logits`;
    "sampled_token" needs `teacher_token_logprobs`; GRPO, the blend and SRPO need `advantages`; SRPO
    also `route_sdpo` and `teacher_entropy`; the pass-rate weights need `pass_rate`.
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
    route_sdpo: Tensor | None = None  # [B] bool, SRPO's branch decided upstream: True = SDPO, False = GRPO
    teacher_entropy: Tensor | None = None  # [B, T] teacher's next-token entropy, full vocabulary (nats)
    pass_rate: Tensor | None = None  # [B] the pass rate of the sample's question (its group)
    sdpo_denominator: Tensor | float | None = None  # whole-batch count for the SDPO term (micro-batching)
    grpo_denominator: Tensor | float | None = None  # whole-batch count for the GRPO and SRPO terms (micro-batching)
    entropy_weight_norm: Tensor | float | None = None  # whole-batch norm of the entropy weights (micro-batching)
    question_weight_norm: Tensor | float | None = None  # whole-batch norm of the question weights (micro-batching)

    def __post_init__(self) -> None:
        if self.student_token_logprobs.ndim != 2:
            shape = tuple(self.student_token_logprobs.shape)
            raise ValueError(f"student_token_logprobs must be [B, T], got {shape}")
        bt = tuple(self.student_token_logprobs.shape)
        per_token = {
            "old_token_logprobs": self.old_token_logprobs,
            "response_mask": self.response_mask,
            "teacher_token_logprobs": self.teacher_token_logprobs,
            "teacher_entropy": self.teacher_entropy,
        }
        for name, value in per_token.items():
            if value is not None and tuple(value.shape) != bt:
                raise ValueError(f"{name} must be [B, T]={bt}, got {tuple(value.shape)}")
        per_sample = {
            "sample_mask": self.sample_mask,
            "advantages": self.advantages,
            "route_sdpo": self.route_sdpo,
            "pass_rate": self.pass_rate,
        }
        for name, value in per_sample.items():
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
        masks = {"response_mask": self.response_mask, "sample_mask": self.sample_mask, "route_sdpo": self.route_sdpo}
        not_bool = {
            name: value.dtype for name, value in masks.items() if value is not None and value.dtype != torch.bool
        }
        if not_bool:
            raise TypeError(f"masks must be bool, got {not_bool}")


@dataclass(frozen=True)
class LossOutputs:
    """The scalar loss to backpropagate and detached float metrics (namespaced `sdpo/`, `grpo/`,
    `srpo/`, `loss/`).

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


def _sdpo_tokens(
    inputs: LossInputs,
    samples: Tensor,
    *,
    divergence: Divergence,
    alpha: float,
    is_clip: float | None,
    srpo_beta: float | None,
    pass_rate_weight: bool,
) -> tuple[Tensor, dict[str, float], dict[str, float]]:
    """The SDPO term per token, [B, T] (weights * D_t, 0 off the tokens of `samples` [B]), and its
    metrics over those tokens. The weights are the importance weights, times the normalised entropy
    weights when `srpo_beta` is set, times the normalised question weights with `pass_rate_weight`."""
    response_mask = inputs.response_mask
    active = response_mask & samples[:, None]  # [B, T]
    per_token, divergence_value = _sdpo_per_token(inputs, divergence=divergence, alpha=alpha)  # [B, T]
    is_weights = importance_weights(inputs.student_token_logprobs, inputs.old_token_logprobs, clip=is_clip)
    weights = is_weights.to(per_token.dtype)
    num_response = int(response_mask.sum())
    num_active = float(active.sum())
    metrics = {
        "sdpo/divergence_mean": masked_token_mean(divergence_value, active),
        "sdpo/active_token_fraction": num_active / num_response if num_response else 0.0,
        "sdpo/active_sample_fraction": float(samples.float().mean()) if samples.numel() else 0.0,
        "sdpo/is_weight_mean": masked_token_mean(is_weights, active),
    }
    counts = {"sdpo/active_token_fraction": float(num_response), "sdpo/active_sample_fraction": float(samples.numel())}
    if is_clip is not None:
        log_ratio = (inputs.student_token_logprobs - inputs.old_token_logprobs).detach()
        metrics["sdpo/is_clip_fraction"] = masked_token_mean((log_ratio.exp() > is_clip).float(), active)
    if divergence in ("topk_tail", "topk_renorm"):
        student_topk, teacher_topk = _topk_logprobs(inputs, divergence=divergence)
        for side, topk in (("student", student_topk), ("teacher", teacher_topk)):
            mass = torch.logsumexp(topk.detach().float(), dim=-1).exp()  # [B, T]
            metrics[f"sdpo/{side}_topk_mass_mean"] = masked_token_mean(mass, active)
    if srpo_beta is not None:
        (entropy,) = _require({"teacher_entropy": inputs.teacher_entropy}, why="loss_type='srpo'")
        raw = entropy_weights(entropy, beta=srpo_beta)  # [B, T]
        token_weights = normalised(raw, active, norm=inputs.entropy_weight_norm)  # [B, T]
        weights = weights * token_weights.to(weights.dtype)
        metrics["srpo/entropy_weight_mean"] = masked_token_mean(token_weights, active)
        metrics["srpo/entropy_weight_low_share"] = masked_token_mean((token_weights < 0.5).float(), active)
        metrics["srpo/entropy_weight_high_share"] = masked_token_mean((token_weights > 2.0).float(), active)
    counts.update({name: num_active for name in metrics if name not in counts})
    if pass_rate_weight:
        (pass_rate,) = _require({"pass_rate": inputs.pass_rate}, why="pass_rate_weight=True")
        sample_weights = normalised(question_weights(pass_rate), samples, norm=inputs.question_weight_norm)  # [B]
        weights = weights * sample_weights.to(weights.dtype)[:, None]
        metrics["sdpo/question_weight_mean"] = masked_token_mean(sample_weights, samples)
        counts["sdpo/question_weight_mean"] = float(samples.sum())
    values = per_token * weights
    return torch.where(active, values, torch.zeros_like(values)), metrics, counts


def _grpo_tokens(
    inputs: LossInputs, samples: Tensor, *, clip_low: float, clip_high: float, ratio_cap: float | None
) -> tuple[Tensor, dict[str, float], dict[str, float]]:
    """The PPO-clip term per token, [B, T] (0 off the tokens of `samples` [B]), and its metrics
    over those tokens and samples."""
    (advantages,) = _require({"advantages": inputs.advantages}, why="the GRPO term")
    active = inputs.response_mask & samples[:, None]  # [B, T]
    ppo_args = (inputs.student_token_logprobs, inputs.old_token_logprobs, advantages, active)
    per_token = ppo_clip_loss(*ppo_args, clip_low=clip_low, clip_high=clip_high, ratio_cap=ratio_cap)  # [B, T]
    clipped = ppo_clipped_mask(*ppo_args, clip_low=clip_low, clip_high=clip_high)  # [B, T]
    log_ratio = (inputs.student_token_logprobs - inputs.old_token_logprobs).detach()
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # [B, T]
    chosen = advantages.detach().float()[samples]
    metrics = {
        "grpo/clip_fraction": masked_token_mean(clipped.float(), active),
        "grpo/ratio_mean": masked_token_mean(ratio, active),
        "grpo/advantage_mean": float(chosen.mean()) if chosen.numel() else 0.0,
        "grpo/advantage_abs_mean": float(chosen.abs().mean()) if chosen.numel() else 0.0,
    }
    tokens = float(active.sum())
    counts = {"grpo/clip_fraction": tokens, "grpo/ratio_mean": tokens}
    if ratio_cap is not None:
        capped = ratio_capped_mask(*ppo_args, ratio_cap=ratio_cap)
        metrics["grpo/ratio_cap_fraction"] = masked_token_mean(capped.float(), active)
        counts["grpo/ratio_cap_fraction"] = tokens
    counts["grpo/advantage_mean"] = counts["grpo/advantage_abs_mean"] = float(chosen.numel())
    return per_token, metrics, counts


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
    srpo_beta: float,
    pass_rate_weight: bool,
    ratio_cap: float | None = None,
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
      The paper's setting for weak models is blend_lambda = 0.9.
    - "srpo": every sample is trained by one of the two terms, as `route_sdpo` says: the SDPO
      per-token term, with its importance weights times the entropy weights exp(-srpo_beta * H_t)
      normalised to mean 1 over the SDPO tokens (`sdpo_core.weights`), on the tokens of samples
      routed to SDPO, the PPO-clip term on the others, and one reduction over all response tokens
      (no mixing coefficient; with token-mean, one token mean over all routed tokens). A sample
      routed to SDPO must have a teacher (`sample_mask`). `srpo_beta` is read only here.

    `pass_rate_weight` multiplies the SDPO term's weights (in "sdpo", "blend" and "srpo") by each
    sample's question weight sqrt(p (1 - p)), normalised to mean 1 over the samples the SDPO term
    trains (`sdpo_core.weights`). `reduction` and `aggregation` are as in
    `sdpo_core.reductions.masked_mean`; `clip_low`/`clip_high` are read only by the GRPO term,
    `divergence`/`alpha`/`is_clip` only by the SDPO term. `ratio_cap` (the dual clip,
    `sdpo_core.grpo.ppo_clip_loss`) bounds the GRPO term's tokens with negative advantage. Only the terms the loss type needs are
    computed, so the other term's inputs may be None.
    """
    if loss_type not in _LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}; expected one of {_LOSS_TYPES}")
    if divergence not in _DIVERGENCES:
        raise ValueError(f"divergence={divergence!r}; expected one of {_DIVERGENCES}")
    if not 0.0 <= blend_lambda <= 1.0:
        raise ValueError(f"blend_lambda={blend_lambda} is outside [0, 1]")
    check_modes(reduction, aggregation)
    mean = partial(masked_mean, response_mask=inputs.response_mask, reduction=reduction, aggregation=aggregation)
    sdpo_tokens = partial(
        _sdpo_tokens, inputs, divergence=divergence, alpha=alpha, is_clip=is_clip, pass_rate_weight=pass_rate_weight
    )
    grpo_tokens = partial(_grpo_tokens, inputs, clip_low=clip_low, clip_high=clip_high, ratio_cap=ratio_cap)
    everyone = torch.ones_like(inputs.sample_mask)

    metrics: dict[str, float] = {}
    counts: dict[str, float] = {}
    if loss_type == "srpo":
        (route,) = _require({"route_sdpo": inputs.route_sdpo}, why="loss_type='srpo'")
        untaught = torch.nonzero(route & ~inputs.sample_mask).flatten()
        if untaught.numel():
            raise ValueError(f"samples {untaught[:8].tolist()} are routed to SDPO but have no teacher (sample_mask)")
        sdpo_x, sdpo_metrics, sdpo_counts = sdpo_tokens(route, srpo_beta=srpo_beta)
        grpo_x, grpo_metrics, grpo_counts = grpo_tokens(~route)
        routed = torch.where(route[:, None], sdpo_x, grpo_x.to(sdpo_x.dtype))  # [B, T]
        loss = mean(routed, sample_mask=everyone, denominator=inputs.grpo_denominator)
        for name, x in (("sdpo", sdpo_x), ("grpo", grpo_x)):  # each branch's share of the loss; they add up to it
            metrics[f"{name}/loss"] = float(mean(x.detach(), sample_mask=everyone, denominator=inputs.grpo_denominator))
        metrics.update({**sdpo_metrics, **grpo_metrics})
        counts.update({**sdpo_counts, **grpo_counts})
    if loss_type in ("sdpo", "blend"):
        sdpo_x, sdpo_metrics, sdpo_counts = sdpo_tokens(inputs.sample_mask, srpo_beta=None)
        sdpo_loss = mean(sdpo_x, sample_mask=inputs.sample_mask, denominator=inputs.sdpo_denominator)
        metrics["sdpo/loss"] = float(sdpo_loss.detach())
        metrics.update(sdpo_metrics)
        counts.update(sdpo_counts)
    if loss_type in ("grpo", "blend"):
        grpo_x, grpo_metrics, grpo_counts = grpo_tokens(everyone)
        grpo_loss = mean(grpo_x, sample_mask=everyone, denominator=inputs.grpo_denominator)
        metrics["grpo/loss"] = float(grpo_loss.detach())
        metrics.update(grpo_metrics)
        counts.update(grpo_counts)

    if loss_type == "sdpo":
        loss = sdpo_loss
    elif loss_type == "grpo":
        loss = grpo_loss
    elif loss_type == "blend":
        loss = blend_lambda * grpo_loss + (1.0 - blend_lambda) * sdpo_loss
    metrics["loss/total"] = float(loss.detach())
    return LossOutputs(loss=loss, metrics=metrics, metric_counts=counts)
