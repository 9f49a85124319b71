"""Evaluation on the held-out split: greedy accuracy, avg@n and pass@k of n sampled answers per prompt,
response lengths, over all prompts and per data source; and the teacher's accuracy."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from storage.manifest import Manifest
from tasks.runtime import Run

logger = logging.getLogger(__name__)


def evaluate_checkpoint(
    run: Run, policy_dir: Path, *, progress: bool = True, policy: Manifest | None = None
) -> dict[str, float]:
    """Accuracy metrics (`accuracy_by_source`) of the checkpoint in `policy_dir` on the eval split
    (`policy`: its manifest, for weights this process kept in memory)."""
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
        policy=policy,
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
        policy=policy,
        n=cfg.eval.sampled_n,
        temperature=cfg.eval.temperature,
        top_p=cfg.eval.top_p,
        seed=cfg.seed + 1,
        iteration=0,
        progress=progress,
    )
    metrics = accuracy_by_source(greedy, sampled, n=cfg.eval.sampled_n)
    metrics["eval/seconds"] = time.perf_counter() - started
    return metrics


def accuracy_by_source(greedy: dict[str, Any], sampled: dict[str, Any], *, n: int) -> dict[str, float]:
    """`sdpo_core.evaluation.accuracy_metrics` of the rollout columns of one greedy answer and `n`
    sampled answers per prompt: over all prompts (`eval/...`) and, when the split mixes data sources,
    per source (`eval/<source>/...`). An answer is correct at reward >= 1."""
    from sdpo_core.evaluation import accuracy_metrics

    def per_prompt(cols: dict[str, Any], size: int) -> dict[int, dict[str, list[Any]]]:
        groups: dict[int, dict[str, list[Any]]] = {}
        for group_id, reward, response, source in zip(
            cols["group_id"], cols["reward"], cols["response_ids"], cols["data_source"], strict=True
        ):
            group = groups.setdefault(int(group_id), {"correct": [], "lengths": [], "source": [source]})
            group["correct"].append(float(reward) >= 1.0)
            group["lengths"].append(len(response))
        sizes = {len(g["correct"]) for g in groups.values()}
        if sizes != {size}:
            raise ValueError(f"evaluation expected {size} answers per prompt, got group sizes {sorted(sizes)}")
        return groups

    greedy_groups, sampled_groups = per_prompt(greedy, 1), per_prompt(sampled, n)
    if greedy_groups.keys() != sampled_groups.keys():
        raise ValueError("the greedy and sampled evaluation answered different prompts")
    ids = sorted(greedy_groups)
    sources = sorted({greedy_groups[i]["source"][0] for i in ids})
    selections = [("eval/", ids)]
    if len(sources) > 1:
        selections += [(f"eval/{s}/", [i for i in ids if greedy_groups[i]["source"][0] == s]) for s in sources]
    metrics: dict[str, float] = {}
    for prefix, chosen in selections:
        metrics.update(
            accuracy_metrics(
                greedy_correct=[greedy_groups[i]["correct"][0] for i in chosen],
                greedy_lengths=[greedy_groups[i]["lengths"][0] for i in chosen],
                sampled_correct=[sampled_groups[i]["correct"] for i in chosen],
                sampled_lengths=[sampled_groups[i]["lengths"] for i in chosen],
                prefix=prefix,
            )
        )
    return metrics


def teacher_accuracy(run: Run, teacher_dir: Path, *, progress: bool = False, teacher: Manifest | None = None) -> float:
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
        policy=teacher,
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
    from storage.checkpoints import resolve_checkpoint
    from storage.faults import crash_point
    from storage.stages import read_eval, write_eval
    from tasks.runtime import checkpoint_dir, open_run, teacher_checkpoint

    run = open_run(root, run_name)
    cached = read_eval(run.layout, iteration)
    if cached is not None:
        return cached
    crash_point("stage.start:eval", iteration)
    policy = resolve_checkpoint(run.layout, f"iter-{iteration}", "policy")
    metrics = evaluate_checkpoint(run, checkpoint_dir(run, iteration, "policy"), policy=policy)
    # The teacher that scores the next iteration, shown the reference answer as a peer solution:
    # SDPO can only distil what this teacher knows (trust-region mixing is not applied here).
    n, kind = teacher_checkpoint(run, iteration + 1)
    teacher = resolve_checkpoint(run.layout, f"iter-{n}", kind)
    metrics["eval/teacher_accuracy"] = teacher_accuracy(run, checkpoint_dir(run, n, kind), teacher=teacher)
    write_eval(run.layout, iteration, metrics)
    return metrics
