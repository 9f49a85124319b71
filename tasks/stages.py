"""One Prefect task per stage. Each takes the run's coordinates and returns a manifest (plain JSON).

The bodies live in the stage modules and import torch, transformers and Megatron lazily, so
importing this module (and so the flows) stays light.
"""

from __future__ import annotations

from typing import Any

from prefect import task


@task(name="prepare-base", retries=0)
def prepare_base(root: str, run: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    from tasks.base_model import ensure_base_checkpoint
    from tasks.runtime import open_run

    return ensure_base_checkpoint(open_run(root, run, storage_options))


@task(name="rollout")
def rollout(root: str, run: str, iteration: int, storage_options: dict[str, Any]) -> dict[str, Any]:
    from tasks.rollout import run_rollout

    return run_rollout(root, run, iteration, storage_options)


@task(name="feedback-teacher-prefill")
def teacher(root: str, run: str, iteration: int, storage_options: dict[str, Any], rollout_manifest: dict[str, Any]) -> dict[str, Any]:
    from tasks.teacher import run_teacher

    return run_teacher(root, run, iteration, storage_options)


@task(name="train")
def train(root: str, run: str, iteration: int, storage_options: dict[str, Any], teacher_manifest: dict[str, Any]) -> dict[str, Any]:
    from tasks.train import run_train

    return run_train(root, run, iteration, storage_options)


@task(name="commit")
def commit(root: str, run: str, iteration: int, storage_options: dict[str, Any], manifests: list[dict[str, Any]]) -> dict[str, Any]:
    from tasks.commit import run_commit

    return run_commit(root, run, iteration, storage_options)


@task(name="evaluate")
def evaluate(root: str, run: str, iteration: int, storage_options: dict[str, Any]) -> dict[str, float]:
    from tasks.evaluate import run_evaluation

    return run_evaluation(root, run, iteration, storage_options)
