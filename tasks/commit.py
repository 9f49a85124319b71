"""Commit stage: the iteration manifest (stage and checkpoint digests, config hash, code version,
metrics), then LATEST. Only then is the iteration done."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

logger = logging.getLogger(__name__)

STAGES = ("rollout", "teacher", "train")


def iteration_metrics(stage_manifests: Sequence[Mapping]) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for manifest in stage_manifests:
        metrics.update({k: float(v) for k, v in manifest.get("metrics", {}).items()})
    return metrics


def run_commit(root: str, run_name: str, iteration: int, handed: Mapping[str, str] | None = None) -> dict:
    """Write iteration `iteration`'s manifest and move LATEST. Idempotent: a committed iteration is
    returned as it is, and a commit killed between its manifest and LATEST is finished.

    What it names is checked first (`storage.adopt`): each stage manifest's content, the parents it
    names, and the digest each stage handed the flow (`handed`: stage -> sha256, when given); a
    manifest left by a killed commit, with everything it names.
    """
    from storage.adopt import adopt_commit_inputs, adopt_iteration_manifest
    from storage.checkpoints import checkpoint_exists, checkpoints_named
    from storage.manifest import commit_iteration, iteration_committed, read_latest, read_stage_manifest
    from tasks.runtime import open_run

    run = open_run(root, run_name)
    if iteration_committed(run.layout, iteration):
        if read_latest(run.layout) != iteration:
            adopt_iteration_manifest(run.layout, iteration)
        return commit_iteration(run.layout, iteration, metrics={})
    stages = adopt_commit_inputs(run.layout, iteration, stages=STAGES, handed=handed)
    train = read_stage_manifest(run.layout, iteration, "train")
    kinds = [
        kind
        for kind in checkpoints_named(run.layout, train, iteration)
        if checkpoint_exists(run.layout, iteration, kind)
    ]
    return commit_iteration(run.layout, iteration, metrics=iteration_metrics(stages), checkpoints=kinds)
