"""One Prefect task per stage. Each takes the run's coordinates and returns a manifest (plain JSON).

Parameters are URLs, numbers and the stage's launch spec (`tasks.config.StageLaunch` as a dict:
where the stage runs) only: Prefect records them, so storage credentials never pass through here
(they come from the environment or the process's registered storage options). Each task starts
its stage through `tasks.launch.launch_stage` and then reads what the stage committed back from
the store, so the stage may have run in this process, in a child process or under torchrun.

The bodies live in the stage modules and import torch, transformers and Megatron lazily, so
importing this module (and so the flows) stays light.

Every stage is safe to retry (it skips itself when its manifest exists and commits atomically), so
Prefect retries a stage that failed on what a second attempt can cure: a dropped connection or a
timeout that escaped the store's own retries, or a stage on a work pool whose flow run Crashed (its
worker or machine was lost: the next attempt is a new flow run, on any live worker of the pool).
Any other failure fails the stage at once.
"""

from __future__ import annotations

import logging
from typing import Any

from prefect import task

logger = logging.getLogger(__name__)

INPROCESS = {"launcher": "inprocess"}
RETRY_DELAYS = [10, 60]  # seconds before the first and the second retry


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect retry condition: connection errors, timeouts and lost work-pool infrastructure only."""
    from tasks.launch import StageInfrastructureLost

    error = state.result(raise_on_failure=False)
    if isinstance(error, StageInfrastructureLost):
        logger.warning("%s: the stage runs again as a new flow run of its deployment", str(error).rstrip("."))
        return True
    return isinstance(error, (ConnectionError, TimeoutError))


RETRIES = {"retries": len(RETRY_DELAYS), "retry_delay_seconds": RETRY_DELAYS, "retry_condition_fn": retry_transient}


def _plain(manifest: Any) -> dict[str, Any]:
    """What a task hands on: the manifest's reference and metrics, plain JSON (never tensors)."""
    return {**manifest.ref, "metrics": dict(manifest.data.get("metrics", {}))}


def _launch(stage: str, root: str, run: str, iteration: int, spec: dict[str, Any] | None) -> None:
    from storage.urls import registered_options
    from tasks.launch import launch_stage

    launch_stage(stage, root, run, iteration, spec or INPROCESS, storage_options=registered_options(root))


def _stage_manifest(root: str, run: str, iteration: int, stage: str) -> dict[str, Any]:
    from storage.layout import RunLayout
    from storage.manifest import read_stage_manifest

    return _plain(read_stage_manifest(RunLayout(root, run), iteration, stage))


@task(name="prepare-base", retries=0)
def prepare_base(root: str, run: str) -> dict[str, Any]:
    from tasks.prepare_base import ensure_base_checkpoint
    from tasks.runtime import open_run

    return ensure_base_checkpoint(open_run(root, run))


@task(name="rollout", task_run_name="{run}/iter-{iteration:04d}/rollout", **RETRIES)
def rollout(root: str, run: str, iteration: int, launch: dict[str, Any] | None = None) -> dict[str, Any]:
    _launch("rollout", root, run, iteration, launch)
    return _stage_manifest(root, run, iteration, "rollout")


@task(name="feedback-teacher-prefill", task_run_name="{run}/iter-{iteration:04d}/teacher", **RETRIES)
def teacher(
    root: str, run: str, iteration: int, rollout_manifest: dict[str, Any], launch: dict[str, Any] | None = None
) -> dict[str, Any]:
    _launch("teacher", root, run, iteration, launch)
    return _stage_manifest(root, run, iteration, "teacher")


@task(name="train", task_run_name="{run}/iter-{iteration:04d}/train", **RETRIES)
def train(
    root: str, run: str, iteration: int, teacher_manifest: dict[str, Any], launch: dict[str, Any] | None = None
) -> dict[str, Any]:
    _launch("train", root, run, iteration, launch)
    return _stage_manifest(root, run, iteration, "train")


@task(name="commit", task_run_name="{run}/iter-{iteration:04d}/commit", **RETRIES)
def commit(root: str, run: str, iteration: int, manifests: list[dict[str, Any]]) -> dict[str, Any]:
    """`manifests`: what the rollout, teacher and train tasks handed on; the commit checks that the
    stage manifests it names still have those digests."""
    from storage.layout import RunLayout
    from tasks import handover
    from tasks.commit import STAGES, run_commit

    handed = {stage: m["sha256"] for stage, m in zip(STAGES, manifests, strict=True)}
    committed = _plain(run_commit(root, run, iteration, handed))
    handover.committed(RunLayout(root, run).run_url, iteration)  # the next stages may write their manifests
    return committed


@task(name="evaluate", task_run_name="{run}/iter-{iteration:04d}/eval", **RETRIES)
def evaluate(root: str, run: str, iteration: int, launch: dict[str, Any] | None = None) -> dict[str, float]:
    from storage.layout import RunLayout
    from storage.stages import read_eval

    _launch("eval", root, run, iteration, launch)
    metrics = read_eval(RunLayout(root, run), iteration)
    if metrics is None:
        raise RuntimeError(f"the eval stage of iteration {iteration} of run {run!r} ended without committing")
    return metrics


@task(name="test-time-baseline", task_run_name="{run}/baseline", **RETRIES)
def test_time_baseline(root: str, run: str) -> dict[str, float]:
    """The base model's attempts at the test-time questions (stage `baseline` of iteration 0); its metrics."""
    from storage.cache import pinned_cache
    from tasks.test_time import run_baseline

    with pinned_cache():
        return dict(run_baseline(root, run)["metrics"])


@task(name="prefetch", task_run_name="{run}/iter-{iteration:04d}/prefetch", **RETRIES)
def prefetch(root: str, run: str, iteration: int, launch: dict[str, Any] | None = None) -> dict[str, Any]:
    """The rollout and teacher prefill of an iteration that runs ahead of the training
    (`pipeline.max_staleness`), in a worker process of the flow's process pool: the store's options
    come from the environment the pool's process inherited (`tasks.launch.OPTIONS_ENV`)."""
    from tasks.launch import register_stage_options

    register_stage_options(root)
    launch = launch or {}
    _launch("rollout", root, run, iteration, launch.get("rollout"))
    _launch("teacher", root, run, iteration, launch.get("teacher"))
    return _stage_manifest(root, run, iteration, "teacher")
