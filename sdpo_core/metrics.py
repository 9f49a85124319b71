"""Metrics of teacher-context building, a warning when self-distillation has nothing to learn from,
and how the loss metrics of micro-batches combine into the metrics of a step."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

from sdpo_core.records import SampleRecord, TeacherContext

EMPTY_TARGET_BATCH = "sdpo/empty_target_batch"

# Last warning time per logger name, for rate limiting across calls.
_last_warning_at: dict[str, float] = {}


def teacher_context_metrics(
    samples: Sequence[SampleRecord],
    contexts: Sequence[TeacherContext],
    *,
    success_threshold: float,
) -> dict[str, float]:
    """Fractions that show whether the teacher had privileged information to offer.

    Samples and contexts are paired by `sample_id` (any order). "Reprompt" means the teacher saw
    something beyond the student prompt (source other than "none").
    - `sdpo/success_group_fraction`: groups with at least one reward >= threshold.
    - `sdpo/success_sample_fraction`: samples with reward >= threshold.
    - `sdpo/feedback_available_fraction`: samples with non-empty feedback text.
    - `sdpo/feedback_used_fraction`: samples whose teacher saw feedback.
    - `sdpo/solution_used_fraction`: samples whose teacher saw a demonstration.
    - `sdpo/reprompt_sample_fraction`: samples whose teacher saw any privileged text.
    - `sdpo/sample_mask_fraction`: samples that are trained on (mask True).
    - `sdpo/empty_target_batch`: 1.0 when every sample is masked out, else 0.0.
    """
    if len(samples) == 0:
        raise ValueError("teacher_context_metrics needs at least one sample")
    by_id = {c.sample_id: c for c in contexts}
    sample_ids = [s.sample_id for s in samples]
    if len(by_id) != len(contexts) or len(set(sample_ids)) != len(samples) or set(by_id) != set(sample_ids):
        raise ValueError(
            "samples and contexts must have the same unique sample_ids; "
            f"only in samples: {sorted(set(sample_ids) - set(by_id))[:8]}, "
            f"only in contexts: {sorted(set(by_id) - set(sample_ids))[:8]}, "
            f"{len(samples)} samples vs {len(contexts)} contexts"
        )

    n = len(samples)
    paired = [(s, by_id[s.sample_id]) for s in samples]
    successes = [s.reward >= success_threshold for s in samples]
    groups: dict[int, bool] = {}
    for s, success in zip(samples, successes, strict=True):
        groups[s.group_id] = groups.get(s.group_id, False) or success
    masks = [c.mask for _, c in paired]
    return {
        "sdpo/success_group_fraction": sum(groups.values()) / len(groups),
        "sdpo/success_sample_fraction": sum(successes) / n,
        "sdpo/feedback_available_fraction": sum(s.feedback is not None and bool(s.feedback.strip()) for s in samples)
        / n,
        "sdpo/feedback_used_fraction": sum(c.source in ("feedback", "solution+feedback") for _, c in paired) / n,
        "sdpo/solution_used_fraction": sum(c.source in ("solution", "solution+feedback") for _, c in paired) / n,
        "sdpo/reprompt_sample_fraction": sum(c.source != "none" for _, c in paired) / n,
        "sdpo/sample_mask_fraction": sum(masks) / n,
        EMPTY_TARGET_BATCH: float(not any(masks)),
    }


def warn_if_inactive(
    metrics: dict[str, float],
    *,
    logger: logging.Logger,
    min_interval_s: float = 60.0,
    clock: Callable[[], float] = time.monotonic,
) -> bool:
    """Log a warning, at most once per `min_interval_s` per logger, when every sample is masked out.

    A batch where no sample has a demonstration or feedback gives zero self-distillation loss, so
    training silently stalls. Returns True when a warning was emitted.
    """
    required = (EMPTY_TARGET_BATCH, "sdpo/success_sample_fraction", "sdpo/feedback_available_fraction")
    missing = [key for key in required if key not in metrics]
    if missing:
        raise KeyError(f"metrics lack {missing}; pass the output of teacher_context_metrics")
    if metrics[EMPTY_TARGET_BATCH] != 1.0:
        return False
    now = clock()
    last = _last_warning_at.get(logger.name)
    if last is not None and now - last < min_interval_s:
        return False
    _last_warning_at[logger.name] = now
    logger.warning(
        "self-distillation is inactive: every sample is masked out (success_sample_fraction=%.3f, "
        "feedback_available_fraction=%.3f), so this batch gives no SDPO loss. Lower "
        "teacher.feedback_kwargs.success_threshold, enable include_environment_feedback (with a verifier "
        "that returns feedback), or increase rollout.group_size so more groups contain a success.",
        metrics["sdpo/success_sample_fraction"],
        metrics["sdpo/feedback_available_fraction"],
    )
    return True


def combine_metrics(parts: Sequence[tuple[Mapping[str, float], Mapping[str, float]]]) -> dict[str, float]:
    """The metrics of a whole step from its micro-batches' `(metrics, metric_counts)` (`sdpo_core.losses.LossOutputs`).

    A counted metric is the mean over every element of the step (each micro-batch's mean weighted
    by its count; 0.0 when no micro-batch had any), so it does not depend on how the step was cut
    into micro-batches; an uncounted one (a loss share) is the sum.
    """
    if not parts:
        raise ValueError("combine_metrics needs at least one micro-batch")
    names = list(parts[0][0])
    for metrics, _ in parts[1:]:
        if list(metrics) != names:
            raise ValueError(f"micro-batches report different metrics: {sorted(metrics)} vs {sorted(names)}")
    out: dict[str, float] = {}
    for name in names:
        if name in parts[0][1]:
            total = sum(counts[name] for _, counts in parts)
            weighted = sum(metrics[name] * counts[name] for metrics, counts in parts)
            out[name] = weighted / total if total else 0.0
        else:
            out[name] = sum(metrics[name] for metrics, _ in parts)
    return out
