"""One Prefect task per stage. Each takes the run's coordinates and returns a manifest (plain JSON).

Parameters are URLs and numbers only: Prefect records them, so storage credentials never pass
through here (they come from the environment or the process's registered storage options).

The bodies live in the stage modules and import torch, transformers and Megatron lazily, so
importing this module (and so the flows) stays light.

Every stage is safe to retry (it skips itself when its manifest exists and commits atomically), so
Prefect retries a stage that failed on what a second attempt can cure: a dropped connection or a
timeout that escaped the store's own retries. Any other failure fails the stage at once.
"""

from __future__ import annotations

from typing import Any

from prefect import task


RETRY_DELAYS = [10, 60]  # seconds before the first and the second retry


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect retry condition: only connection errors and timeouts are retried."""
    return isinstance(state.result(raise_on_failure=False), (ConnectionError, TimeoutError))


RETRIES = {"retries": len(RETRY_DELAYS), "retry_delay_seconds": RETRY_DELAYS, "retry_condition_fn": retry_transient}


def _plain(manifest: Any) -> dict[str, Any]:
    """What a task hands on: the manifest's reference and metrics, plain JSON (never tensors)."""
    return {**manifest.ref, "metrics": dict(manifest.data.get("metrics", {}))}


@task(name="prepare-base", retries=0)
def prepare_base(root: str, run: str) -> dict[str, Any]:
    from tasks.base_model import ensure_base_checkpoint
    from tasks.runtime import open_run

    return ensure_base_checkpoint(open_run(root, run))


@task(name="rollout", task_run_name="{run}/iter-{iteration:04d}/rollout", **RETRIES)
def rollout(root: str, run: str, iteration: int) -> dict[str, Any]:
    from tasks.rollout import run_rollout

    return _plain(run_rollout(root, run, iteration))


@task(name="feedback-teacher-prefill", task_run_name="{run}/iter-{iteration:04d}/teacher", **RETRIES)
def teacher(root: str, run: str, iteration: int, rollout_manifest: dict[str, Any]) -> dict[str, Any]:
    from tasks.teacher import run_teacher

    return _plain(run_teacher(root, run, iteration))


@task(name="train", task_run_name="{run}/iter-{iteration:04d}/train", **RETRIES)
def train(root: str, run: str, iteration: int, teacher_manifest: dict[str, Any]) -> dict[str, Any]:
    from tasks.train import run_train

    return _plain(run_train(root, run, iteration))


@task(name="commit", task_run_name="{run}/iter-{iteration:04d}/commit", **RETRIES)
def commit(root: str, run: str, iteration: int, manifests: list[dict[str, Any]]) -> dict[str, Any]:
    from tasks.commit import run_commit

    return _plain(run_commit(root, run, iteration))


@task(name="evaluate", task_run_name="{run}/iter-{iteration:04d}/eval", **RETRIES)
def evaluate(root: str, run: str, iteration: int) -> dict[str, float]:
    from tasks.evaluate import run_evaluation

    return run_evaluation(root, run, iteration)
