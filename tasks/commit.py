"""Commit stage: the iteration manifest (parents, digests, config hash, code version, metrics), then LATEST."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

STAGES = ("rollout", "teacher", "train")


def iteration_metrics(stage_manifests: list[dict]) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for manifest in stage_manifests:
        metrics.update({k: float(v) for k, v in manifest.get("metrics", {}).items()})
    return metrics


def run_commit(root: str, run_name: str, iteration: int, storage_options: dict | None = None) -> dict:
    """Write iteration `iteration`'s manifest and move LATEST; idempotent once committed."""
    from storage.manifest import commit_iteration, iteration_committed, read_iteration_manifest, read_stage_manifest
    from tasks.config import config_hash
    from tasks.runtime import open_run

    run = open_run(root, run_name, storage_options)
    if iteration_committed(run.layout, iteration):
        return read_iteration_manifest(run.layout, iteration)
    stages = [read_stage_manifest(run.layout, iteration, stage) for stage in STAGES]
    return commit_iteration(
        run.layout,
        iteration,
        parents=stages,
        metrics=iteration_metrics(stages),
        config_hash=config_hash(run.cfg),
    )
