"""Commit stage: the iteration manifest (stage and checkpoint digests, config hash, code version,
metrics), then LATEST. Only then is the iteration done."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

STAGES = ("rollout", "teacher", "train")


def iteration_metrics(stage_manifests: list[dict]) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for manifest in stage_manifests:
        metrics.update({k: float(v) for k, v in manifest.get("metrics", {}).items()})
    return metrics


def run_commit(root: str, run_name: str, iteration: int) -> dict:
    """Write iteration `iteration`'s manifest and move LATEST. Idempotent: a committed iteration is
    returned as it is, and a commit killed between its manifest and LATEST is finished."""
    from storage.checkpoints import checkpoint_exists
    from storage.manifest import commit_iteration, iteration_committed, read_stage_manifest
    from tasks.runtime import open_run

    run = open_run(root, run_name)
    if iteration_committed(run.layout, iteration):
        return commit_iteration(run.layout, iteration, metrics={})
    stages = [read_stage_manifest(run.layout, iteration, stage) for stage in STAGES]
    kinds = [kind for kind in ("policy", "teacher", "megatron") if checkpoint_exists(run.layout, iteration, kind)]
    return commit_iteration(run.layout, iteration, metrics=iteration_metrics(stages), checkpoints=kinds)
