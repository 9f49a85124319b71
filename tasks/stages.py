"""One Prefect task per stage. Each takes the run's coordinates and returns a manifest (plain JSON).

Parameters are URLs and numbers only: Prefect records them, so storage credentials never pass
through here (they come from the environment or the process's registered storage options).

The bodies live in the stage modules and import torch, transformers and Megatron lazily, so
importing this module (and so the flows) stays light.
"""

from __future__ import annotations

from typing import Any

from prefect import task


def _plain(manifest: Any) -> dict[str, Any]:
    """What a task hands on: the manifest's reference and metrics, plain JSON (never tensors)."""
    return {**manifest.ref, "metrics": dict(manifest.data.get("metrics", {}))}


@task(name="prepare-base", retries=0)
def prepare_base(root: str, run: str) -> dict[str, Any]:
    from tasks.base_model import ensure_base_checkpoint
    from tasks.runtime import open_run

    return ensure_base_checkpoint(open_run(root, run))


@task(name="rollout")
def rollout(root: str, run: str, iteration: int) -> dict[str, Any]:
    from tasks.rollout import run_rollout

    return _plain(run_rollout(root, run, iteration))


@task(name="feedback-teacher-prefill")
def teacher(root: str, run: str, iteration: int, rollout_manifest: dict[str, Any]) -> dict[str, Any]:
    from tasks.teacher import run_teacher

    return _plain(run_teacher(root, run, iteration))


@task(name="train")
def train(root: str, run: str, iteration: int, teacher_manifest: dict[str, Any]) -> dict[str, Any]:
    from tasks.train import run_train

    return _plain(run_train(root, run, iteration))


@task(name="commit")
def commit(root: str, run: str, iteration: int, manifests: list[dict[str, Any]]) -> dict[str, Any]:
    from tasks.commit import run_commit

    return _plain(run_commit(root, run, iteration))


@task(name="evaluate")
def evaluate(root: str, run: str, iteration: int) -> dict[str, float]:
    from tasks.evaluate import run_evaluation

    return run_evaluation(root, run, iteration)
