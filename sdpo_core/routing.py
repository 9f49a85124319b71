"""What the teacher stage decides per sample from its group, beyond the teacher context: SRPO's route
and the pass rate of the sample's question, plus the stage metrics of both.

The decisions travel to the trainer as shard columns (`route`, `pass_rate`), like the sample mask,
so the trainer applies them without knowing how they were made.

SRPO (sample routing) trains a sample with the SDPO loss when it failed (reward below the success
threshold) and its self-teacher has something to teach it, and with the GRPO loss otherwise (the
successes, and failures nothing in their group can teach). Two rules say what "something to teach"
is:

- "failed_with_solution", the paper's rule: the teacher saw a successful sibling's answer, that is
  the group holds a success other than the sample that the feedback policy shows as a
  demonstration (a success whose demonstration text is empty, an answer cut off inside `<think>`,
  teaches nothing and does not count).
- "failed_with_teacher": the teacher saw any privileged text, a sibling's answer or the
  environment's feedback on this very sample. With rich feedback (failing test cases, error
  messages) a failure whose group has no success still gets a teacher.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, get_args

import torch
from torch import Tensor

from sdpo_core.records import SampleRecord, TeacherContext
from sdpo_core.weights import entropy_weights, question_weights, weight_norm

RouteRule = Literal["failed_with_solution", "failed_with_teacher"]
ROUTE_RULES: tuple[str, ...] = get_args(RouteRule)
Route = Literal["sdpo", "grpo"]
ROUTES: tuple[str, ...] = get_args(Route)
PERCENTILES = (10, 50, 90)


def _check_threshold(success_threshold: float) -> None:
    if not math.isfinite(success_threshold):
        raise ValueError(f"success_threshold must be finite, got {success_threshold!r}")


def route_samples(
    samples: Sequence[SampleRecord],
    contexts: Sequence[TeacherContext],
    *,
    success_threshold: float,
    rule: RouteRule,
) -> list[Route]:
    """Each sample's branch, "sdpo" or "grpo", in the order of `samples` (contexts paired by sample_id).

    A sample routed to "sdpo" always has a teacher (`TeacherContext.mask`), so the SDPO term never
    sees a sample without one.
    """
    if rule not in ROUTE_RULES:
        raise ValueError(f"rule={rule!r}; expected one of {ROUTE_RULES}")
    _check_threshold(success_threshold)
    by_id = {c.sample_id: c for c in contexts}
    missing = [s.sample_id for s in samples if s.sample_id not in by_id]
    if missing or len(by_id) != len(contexts) or len(contexts) != len(samples):
        raise ValueError(
            f"samples and contexts must pair one to one by sample_id: {len(samples)} samples, "
            f"{len(contexts)} contexts, samples without a context {missing[:8]}"
        )
    routes: list[Route] = []
    for sample in samples:
        context = by_id[sample.sample_id]
        failed = sample.reward < success_threshold
        if rule == "failed_with_solution":
            taught = context.source in ("solution", "solution+feedback")
        else:
            taught = context.mask
        routes.append("sdpo" if failed and taught else "grpo")
    return routes


def pass_rates(rewards: Sequence[float], group_ids: Sequence[int], *, success_threshold: float) -> list[float]:
    """Each sample's question pass rate: the share of its group with reward >= `success_threshold`.

    The sample itself is counted (a group of G samples with k successes gives every member k / G).
    Groups are the samples sharing an id, in any order.
    """
    if len(rewards) != len(group_ids):
        raise ValueError(f"rewards and group_ids differ in length: {len(rewards)} vs {len(group_ids)}")
    _check_threshold(success_threshold)
    bad = [(i, r) for i, r in enumerate(rewards) if not math.isfinite(r)]
    if bad:
        raise ValueError(f"rewards must be finite; (index, reward) offenders: {bad[:8]}")
    successes: dict[int, int] = {}
    sizes: dict[int, int] = {}
    for reward, group in zip(rewards, group_ids, strict=True):
        sizes[group] = sizes.get(group, 0) + 1
        successes[group] = successes.get(group, 0) + int(reward >= success_threshold)
    return [successes[g] / sizes[g] for g in group_ids]


def _percentiles(values: Tensor, prefix: str, *, mean: bool = True) -> dict[str, float]:
    """Nearest-rank percentiles p10 / p50 / p90 (and the mean) of a 1-D tensor (0.0 for an empty one)."""
    out = {f"{prefix}_mean": float(values.double().mean()) if values.numel() else 0.0} if mean else {}
    ordered = torch.sort(values.double()).values
    for p in PERCENTILES:
        index = round(p / 100 * (ordered.numel() - 1))
        out[f"{prefix}_p{p}"] = float(ordered[index]) if ordered.numel() else 0.0
    return out


def entropy_metrics(entropy: Tensor) -> dict[str, float]:
    """`teacher/entropy_{mean,p10,p50,p90}` over every scored response token ([N] nats)."""
    return _percentiles(entropy.reshape(-1), "teacher/entropy")


def routing_metrics(routes: Sequence[str], entropy: Tensor, sdpo_tokens: Tensor, *, beta: float) -> dict[str, float]:
    """SRPO's stage metrics: the shares of samples routed each way, and over the tokens routed to SDPO
    ([N] bool `sdpo_tokens` beside the [N] `entropy`) the teacher entropy and the entropy weights.

    The weights are normalised over all of the stage's SDPO tokens: what the trainer applies when one
    optimizer step takes the whole iteration (`train.steps_per_iteration = 1`); with more steps each
    step normalises over its own mini-batch.
    """
    unknown = sorted(set(routes) - set(ROUTES))
    if unknown:
        raise ValueError(f"routes must be {ROUTES}, got {unknown}")
    n = len(routes)
    metrics = {
        "srpo/routed_sdpo_share": sum(r == "sdpo" for r in routes) / n if n else 0.0,
        "srpo/routed_grpo_share": sum(r == "grpo" for r in routes) / n if n else 0.0,
    }
    chosen = entropy.reshape(-1)[sdpo_tokens.reshape(-1)]
    metrics.update(_percentiles(chosen, "srpo/teacher_entropy"))
    raw = entropy_weights(chosen, beta=beta)
    weights = raw / weight_norm(raw, torch.ones_like(raw, dtype=torch.bool)).clamp(min=1e-30)
    metrics.update(_percentiles(weights, "srpo/entropy_weight", mean=False))  # the mean is 1
    metrics["srpo/entropy_weight_max"] = float(weights.max()) if weights.numel() else 0.0
    return metrics


def question_weight_metrics(pass_rate: Tensor, trained: Tensor) -> dict[str, float]:
    """Pass-rate weighted SDPO's stage metrics over the SDPO-trained samples ([B] `trained`): the mean
    pass rate, the share with weight 0 (questions all or none of the group solved), and the question
    weights normalised over those samples (as the trainer applies them with one step per iteration)."""
    p = pass_rate.reshape(-1)[trained.reshape(-1)].double()
    raw = question_weights(p)
    norm = weight_norm(raw, torch.ones_like(raw, dtype=torch.bool))
    weights = raw / norm if float(norm) > 0 else torch.zeros_like(raw)
    metrics = {
        "sdpo/pass_rate_mean": float(p.mean()) if p.numel() else 0.0,
        "sdpo/question_weight_zero_share": float((raw == 0).double().mean()) if p.numel() else 0.0,
    }
    metrics.update(_percentiles(weights, "sdpo/question_weight", mean=False))  # the mean is 1
    return metrics
