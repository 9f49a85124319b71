"""Evaluation on the held-out split: greedy accuracy and sampled accuracy (n answers per prompt)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from tasks.runtime import Run

logger = logging.getLogger(__name__)


def evaluate_checkpoint(run: Run, policy_dir: Path, *, progress: bool = True) -> dict[str, float]:
    """Greedy and sampled accuracy of the checkpoint in `policy_dir` on the eval split."""
    from tasks.data.prompts import load_splits
    from tasks.rollout import sample_groups

    cfg = run.cfg
    _, eval_rows = load_splits(cfg.data, seed=cfg.seed)
    rows = eval_rows[: cfg.data.eval_prompts]
    started = time.perf_counter()
    greedy, _ = sample_groups(
        run,
        rows=rows,
        policy_dir=policy_dir,
        n=1,
        temperature=0.0,
        top_p=1.0,
        seed=cfg.seed,
        iteration=0,
        progress=progress,
    )
    sampled, _ = sample_groups(
        run,
        rows=rows,
        policy_dir=policy_dir,
        n=cfg.eval.sampled_n,
        temperature=cfg.eval.temperature,
        top_p=cfg.eval.top_p,
        seed=cfg.seed + 1,
        iteration=0,
        progress=progress,
    )
    return {
        "eval/greedy_accuracy": float(np.mean(np.asarray(greedy["reward"]) >= 1.0)),
        "eval/sampled_accuracy": float(np.mean(np.asarray(sampled["reward"]) >= 1.0)),
        "eval/response_length_mean": float(np.mean([len(r) for r in greedy["response_ids"]])),
        "eval/prompts": float(len(rows)),
        "eval/seconds": time.perf_counter() - started,
    }


def teacher_accuracy(run: Run, teacher_dir: Path, *, progress: bool = False) -> float:
    """Greedy accuracy on the eval split of the teacher with the reference answer in context as a
    peer's solution (rendered by `build_teacher_messages`): the gap SDPO distils."""
    from sdpo_core.teacher_context import build_teacher_messages
    from tasks.data.prompts import load_splits
    from tasks.rollout import sample_groups

    cfg = run.cfg
    _, eval_rows = load_splits(cfg.data, seed=cfg.seed)
    rows = [
        dict(
            row,
            prompt_messages=list(build_teacher_messages(row["prompt_messages"], solution=row["label"], feedback=None)),
        )
        for row in eval_rows[: cfg.data.eval_prompts]
    ]
    cols, _ = sample_groups(
        run,
        rows=rows,
        policy_dir=teacher_dir,
        n=1,
        temperature=0.0,
        top_p=1.0,
        seed=cfg.seed,
        iteration=0,
        progress=progress,
    )
    return float(np.mean(np.asarray(cols["reward"]) >= 1.0))


def run_evaluation(root: str, run_name: str, iteration: int) -> dict[str, float]:
    """Evaluate the policy written by `iteration` (0 = the initial model); cached in the store."""
    from storage.faults import crash_point
    from storage.stages import read_eval, write_eval
    from tasks.runtime import checkpoint_dir, open_run, teacher_source

    run = open_run(root, run_name)
    cached = read_eval(run.layout, iteration)
    if cached is not None:
        return cached
    crash_point("stage.start:eval", iteration)
    metrics = evaluate_checkpoint(run, checkpoint_dir(run, iteration, "policy"))
    # The teacher that scores the next iteration, shown the reference answer as a peer solution:
    # SDPO can only distil what this teacher knows (trust-region mixing is not applied here).
    teacher_dir, _ = teacher_source(run, iteration + 1)
    metrics["eval/teacher_accuracy"] = teacher_accuracy(run, teacher_dir)
    write_eval(run.layout, iteration, metrics)
    return metrics
