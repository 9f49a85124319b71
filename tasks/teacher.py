"""Feedback + teacher-prefill stage.

Groups the rollout rows, asks the configured feedback class for each sample's teacher messages and
mask, renders them with the student's chat template, and scores `teacher_prompt_ids +
response_ids` with the teacher weights (forward only), gathering log-probs on the student's top-K
ids and on the sampled token, and the teacher's next-token entropy over the full vocabulary (every
teacher backend has the full logits, so it is exact). The response ids are never re-tokenised.
GRPO advantages, each question's pass rate and, for SRPO, each sample's route are decided here
too, so the trainer receives every per-sample decision as a column.

Output: `iter-<n>/teacher` shards holding the teacher columns and each row's `sample_id`, row for row
in the rollout's order (readers get the rollout's columns joined to them, `storage.shard_reader`),
and the stage manifest, which names the rollout it extends.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Any

import numpy as np

from tasks.config import RunConfig
from tasks.runtime import Run

logger = logging.getLogger(__name__)


def feedback_policy(cfg: RunConfig) -> Any:
    """The run's configured `FeedbackPolicy`."""
    from sdpo_core.feedback import load_feedback

    return load_feedback(cfg.teacher.feedback, dict(cfg.teacher.feedback_kwargs))


def sample_records(columns: dict[str, Any]) -> list[Any]:
    """One `SampleRecord` per row of rollout columns (as `read_stage_columns` returns them), in row order."""
    from sdpo_core.records import SampleRecord

    return [
        SampleRecord(
            sample_id=int(columns["sample_id"][i]),
            group_id=int(columns["group_id"][i]),
            prompt_messages=tuple(dict(m) for m in columns["prompt_messages"][i]),
            response_text=columns["response_text"][i],
            reward=float(columns["reward"][i]),
            feedback=columns["feedback"][i],
            finish_reason=columns["finish_reason"][i],
            format_error=bool(columns["format_error"][i]),
            teacher_prompt=columns["teacher_prompt"][i],
        )
        for i in range(len(columns["sample_id"]))
    ]


def success_threshold(policy: Any) -> float:
    """The reward from which the feedback policy counts an answer a success; OPD and OPSD have no
    threshold, for them it is a perfect answer (1.0)."""
    from sdpo_core.feedback import RelaxSDPOFeedback, SDPOFeedback

    return policy.success_threshold if isinstance(policy, (SDPOFeedback, RelaxSDPOFeedback)) else 1.0


def routes(cfg: RunConfig, samples: list[Any], contexts: list[Any]) -> list[str | None]:
    """Each sample's SRPO route ("sdpo" or "grpo") in row order; None for losses that do not route."""
    from sdpo_core.routing import route_samples

    if cfg.loss.type != "srpo":
        return [None] * len(samples)
    threshold = success_threshold(feedback_policy(cfg))
    return list(route_samples(samples, contexts, success_threshold=threshold, rule=cfg.loss.srpo.route))


def build_contexts(run: Run, columns: dict[str, Any]) -> tuple[list[Any], dict[str, float]]:
    """Teacher contexts for every rollout row, in row order, and the context metrics."""
    from sdpo_core.metrics import teacher_context_metrics, warn_if_inactive

    policy = feedback_policy(run.cfg)
    samples = sample_records(columns)
    groups: dict[int, list[Any]] = defaultdict(list)
    for sample in samples:
        groups[sample.group_id].append(sample)
    by_id = {}
    for group in groups.values():
        for ctx in policy.prepare_group(group):
            by_id[ctx.sample_id] = ctx
    contexts = [by_id[s.sample_id] for s in samples]
    metrics = teacher_context_metrics(samples, contexts, success_threshold=success_threshold(policy))
    warn_if_inactive(metrics, logger=logger)
    return contexts, metrics


def clipped_advantages(run: Run, iteration: int, advantages: Any, metrics: dict[str, float]) -> Any:
    """`advantages` [N] clipped to +- loss.advantage_clip times the mean |A| over the run's
    iterations so far, this one included; the running sums come from the previous iteration's
    teacher manifest (the store holds them, not the process), and go on in `metrics`."""
    from sdpo_core.grpo import clip_advantages, running_abs_mean
    from storage.manifest import read_stage_manifest

    previous = read_stage_manifest(run.layout, iteration - 1, "teacher").data["metrics"] if iteration > 1 else {}
    total, count = running_abs_mean(
        advantages,
        previous_sum=float(previous.get("grpo/advantage_abs_sum", 0.0)),
        previous_count=float(previous.get("grpo/advantage_count", 0.0)),
    )
    mean = total / count if count else 0.0
    clipped = clip_advantages(advantages, running_abs_mean=mean, multiple=float(run.cfg.loss.advantage_clip or 0.0))
    metrics["grpo/advantage_abs_sum"] = total
    metrics["grpo/advantage_count"] = count
    metrics["grpo/advantage_running_mean"] = mean
    metrics["grpo/advantage_clip_fraction"] = (
        float((clipped != advantages).float().mean()) if advantages.numel() else 0.0
    )
    return clipped


def run_teacher(root: str, run_name: str, iteration: int) -> dict | None:
    """Teacher stage of `iteration`: returns its manifest (a committed one is checked, then reused).

    Under torchrun (teacher.backend=megatron) every rank scores a data-parallel share of the
    sequences, tensor parallel inside each share; rank 0 gathers and writes (the others return None)."""
    import torch

    from sdpo_core.grpo import group_advantages
    from sdpo_core.routing import pass_rates
    from storage.adopt import adopt_stage
    from storage.manifest import read_stage_manifest, stage_done
    from storage.shard_reader import read_stage_columns
    from storage.shard_writer import write_shards
    from tasks import scoring_models
    from tasks.engines.scorer import score_teacher
    from tasks.handover import open_checkpoint
    from tasks.rollout import render_prompt_ids
    from tasks.runtime import open_run, teacher_checkpoint
    from tasks.tokenizers import checkpoint_tokenizer

    run = open_run(root, run_name)
    cfg = run.cfg
    if stage_done(run.layout, iteration, "teacher"):
        # committed by an earlier attempt: checked against its digests before it is reused
        manifest = adopt_stage(run.layout, iteration, "teacher", hash_files=cfg.storage.verify_sha256)
        logger.info("iteration %d teacher stage already committed; checked, reusing it", iteration)
        return manifest
    from storage.faults import crash_point

    crash_point("stage.start:teacher", iteration)

    started = time.perf_counter()
    parent = read_stage_manifest(run.layout, iteration, "rollout")
    columns = read_stage_columns(run.layout, iteration, "rollout", verify=cfg.storage.verify_sha256)
    n_rows = len(columns["sample_id"])

    rewards = torch.from_numpy(np.array(columns["reward"], dtype=np.float32))
    group_ids = torch.from_numpy(np.array(columns["group_id"], dtype=np.int64))
    advantages = group_advantages(rewards, group_ids, normalize_std=cfg.loss.grpo_normalize_std)
    threshold = success_threshold(feedback_policy(cfg))
    rates = pass_rates(rewards.tolist(), group_ids.tolist(), success_threshold=threshold)

    source_n, source_kind = teacher_checkpoint(run, iteration)
    metrics: dict[str, float] = {"teacher/source_iteration": float(source_n)}
    if cfg.loss.advantage_clip is not None:
        advantages = clipped_advantages(run, iteration, advantages, metrics)
    # handed over in memory while its iteration commits (tasks/handover.py), else the stored one
    teacher = open_checkpoint(run, source_n, source_kind)
    # the trust region's reference, the base policy, read only when there is one
    base = open_checkpoint(run, 0, "policy") if cfg.teacher.update == "trust-region" else None
    tokenizer = checkpoint_tokenizer(teacher.folder, teacher.stand_in)
    k = int(columns["topk_ids"][0].shape[1]) if n_rows else cfg.rollout.top_k

    if cfg.loss.type == "grpo":
        # Pure GRPO needs no teacher: the columns exist (one schema) but carry no signal.
        teacher_messages = [list(m) for m in columns["prompt_messages"]]
        teacher_ids = [list(map(int, ids)) for ids in columns["prompt_ids"]]
        sources = ["none"] * n_rows
        masks = [False] * n_rows
        topk_lp = [np.zeros((len(r), k), dtype=np.float32) for r in columns["response_ids"]]
        token_lp = [np.zeros((len(r),), dtype=np.float32) for r in columns["response_ids"]]
        entropy = [np.zeros((len(r),), dtype=np.float32) for r in columns["response_ids"]]
        route: list[str | None] = [None] * n_rows
    else:
        contexts, ctx_metrics = build_contexts(run, columns)
        metrics.update(ctx_metrics)
        teacher_messages = [list(c.messages) for c in contexts]
        teacher_ids = render_prompt_ids(tokenizer, teacher_messages, cfg.model.chat_template_kwargs)
        sources = [c.source for c in contexts]
        masks = [bool(c.mask) for c in contexts]
        sequences = [(t, list(map(int, r))) for t, r in zip(teacher_ids, columns["response_ids"], strict=True)]
        rate = cfg.teacher.update_rate if base is not None else None
        score_started = time.perf_counter()
        if cfg.teacher.backend == "megatron":
            from tasks.megatron.scorer import score_teacher_megatron

            scored = score_teacher_megatron(
                scoring_models.megatron_scorer(run, teacher, base),
                sequences=sequences,
                topk_ids=list(columns["topk_ids"]),
                batch_tokens=cfg.teacher.batch_tokens,
                trust_region_rate=rate,
            )
        else:
            model = scoring_models.hf_scorer(run, "teacher", teacher)
            reference = None
            if base is not None:
                reference = scoring_models.hf_scorer(run, "reference", base)
            scored = score_teacher(
                model,
                sequences=sequences,
                topk_ids=list(columns["topk_ids"]),
                batch_tokens=cfg.teacher.batch_tokens,
                reference_model=reference,
                trust_region_rate=rate,
            )
        score_seconds = time.perf_counter() - score_started
        topk_lp = [s.topk_logprobs for s in scored]
        token_lp = [s.sampled_logprobs for s in scored]
        entropy = [s.entropy for s in scored]
        route = routes(cfg, sample_records(columns), contexts)
        metrics.update(decision_metrics(cfg, route=route, entropy=entropy, pass_rate=rates, mask=masks))
        scored_tokens = sum(len(t) + len(r) for t, r in zip(teacher_ids, columns["response_ids"], strict=True))
        metrics["teacher/score_seconds"] = score_seconds
        metrics["teacher/tokens_per_second"] = scored_tokens / max(score_seconds, 1e-9)
        metrics["teacher/prompt_length_mean"] = float(np.mean([len(t) for t in teacher_ids])) if n_rows else 0.0
        # the processes that scored (torchrun ranks of the Megatron scorer), for per-GPU rates
        distributed = torch.distributed.is_initialized()
        metrics["teacher/ranks"] = float(torch.distributed.get_world_size()) if distributed else 1.0

    out: dict[str, Any] = {"sample_id": columns["sample_id"]}  # the rollout's rows, in their order
    out["teacher_prompt_ids"] = teacher_ids
    out["teacher_prompt_text"] = [tokenizer.decode(ids, skip_special_tokens=False) for ids in teacher_ids]
    out["teacher_source"] = sources
    out["sample_mask"] = masks
    out["teacher_topk_logprobs"] = topk_lp
    out["teacher_sampled_logprobs"] = token_lp
    out["advantage"] = advantages.numpy().astype(np.float32).tolist()
    out["route"] = route
    out["pass_rate"] = np.asarray(rates, dtype=np.float32)
    out["teacher_entropy"] = entropy
    metrics["teacher/sample_mask_fraction"] = float(np.mean(masks)) if n_rows else 0.0
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return None  # under torchrun every rank scored its share; rank 0 writes the stage
    written = time.perf_counter()
    output = write_shards(run.layout, iteration, "teacher", out, top_k=k, logprob_dtype=cfg.storage.logprob_dtype)
    metrics["teacher/write_seconds"] = time.perf_counter() - written
    metrics["teacher/stage_seconds"] = time.perf_counter() - started  # its shards written; the manifest holds it
    if teacher.handed_over:
        crash_point("teacher.awaiting_parent_commit", iteration)
    waited = time.perf_counter()
    scored_by = teacher.manifest()  # the checkpoint whose weights scored it, once committed
    metrics["teacher/parent_wait_seconds"] = time.perf_counter() - waited
    # parents: the rollout it scored and the teacher checkpoint
    return output.commit(parents=[parent, scored_by], metrics=metrics)


def decision_metrics(
    cfg: RunConfig, *, route: list[str | None], entropy: list[Any], pass_rate: list[float], mask: list[bool]
) -> dict[str, float]:
    """The teacher's entropy over every scored token, and what the loss's per-sample decisions
    look like: SRPO's routed shares and entropy weights, the pass-rate question weights."""
    import torch

    from sdpo_core.routing import entropy_metrics, question_weight_metrics, routing_metrics

    flat = torch.from_numpy(
        np.concatenate([np.zeros(0, dtype=np.float32), *(np.asarray(e, np.float32) for e in entropy)])
    )
    metrics = entropy_metrics(flat)
    if cfg.loss.type == "srpo":
        lengths = [len(e) for e in entropy]
        sdpo_tokens = torch.from_numpy(np.repeat(np.asarray([r == "sdpo" for r in route], dtype=bool), lengths))
        metrics.update(routing_metrics([str(r) for r in route], flat, sdpo_tokens, beta=cfg.loss.srpo.beta))
    if cfg.loss.pass_rate_weight:
        trained = [r == "sdpo" for r in route] if cfg.loss.type == "srpo" else mask
        metrics.update(
            question_weight_metrics(
                torch.tensor(pass_rate, dtype=torch.float64), torch.tensor(trained, dtype=torch.bool)
            )
        )
    return metrics
