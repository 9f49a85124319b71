"""One SDPO iteration as a Prefect flow: rollout -> feedback + teacher prefill -> train -> commit.

Each stage skips itself when its manifest already exists, so re-running a failed or killed
iteration resumes at the first stage without one. `complete_iteration` brings an iteration all
the way to done (committed, evaluated when due, its step in MLflow); both the whole-run flow and
the scheduled one-iteration flow advance a run through it, so they leave the same run behind.
"""

from __future__ import annotations

import logging
from typing import Any

from prefect import flow

from tasks import stages

logger = logging.getLogger(__name__)


@flow(name="sdpo-iteration", log_prints=False)
def sdpo_iteration(root: str, run: str, iteration: int, launch: dict[str, Any] | None = None) -> dict[str, Any]:
    """Advance run `run` under `root` by iteration `iteration`; returns the iteration manifest.

    `launch` maps a stage to where it runs (`tasks.config.LaunchConfig` as a dict); absent: in this process.
    """
    launch = launch or {}
    rollout = stages.rollout(root, run, iteration, launch.get("rollout"))
    teacher = stages.teacher(root, run, iteration, rollout, launch.get("teacher"))
    trained = stages.train(root, run, iteration, teacher, launch.get("train"))
    return stages.commit(root, run, iteration, [rollout, teacher, trained])


def eval_due(n: int, *, every: int, last: int) -> bool:
    """The base model, the last iteration and every `every`-th are evaluated."""
    return n == 0 or n == last or (every > 0 and n % every == 0)


def complete_iteration(run: Any, tracker: Any, n: int) -> tuple[dict[str, float], bool]:
    """Iteration n of `run` done: committed (n > 0), evaluated when due, logged to MLflow once,
    and the checkpoints retention does not keep pruned.

    Returns (the step's metrics, whether this call trained the iteration). Everything is read back
    from the store, so a call after a crash finishes what the crashed process left undone.
    """
    from storage.manifest import read_iteration_manifest, read_latest
    from storage.stages import read_eval
    from tasks.runtime import apply_retention

    cfg, root, name = run.cfg, run.layout.root_url, run.layout.run_name
    launch = cfg.launch.model_dump(mode="json")
    ran = False
    metrics: dict[str, float] = {}
    if n > 0:
        if (read_latest(run.layout) or 0) < n:
            sdpo_iteration(root, name, n, launch)
            ran = True
        metrics.update(read_iteration_manifest(run.layout, n).data["metrics"])
    if eval_due(n, every=cfg.eval.every, last=cfg.iterations):
        evaluated = read_eval(run.layout, n)
        metrics.update(evaluated if evaluated is not None else stages.evaluate(root, name, n, launch["eval"]))
    tracker.log_step(n, metrics)
    if ran or n == cfg.iterations:
        apply_retention(run)
    return metrics, ran


@flow(name="sdpo-advance", log_prints=False)
def sdpo_advance(
    config_path: str,
    overrides: list[str] | None = None,
    allow_config_change: bool = False,
    force_unlock: bool = False,
) -> dict[str, Any] | None:
    """Run the next iteration of the configured run (for scheduled deployments); None when done.

    Creates the run when it does not exist. One flow run, one iteration, one process: what it
    leaves is what `sdpo run` leaves after the same iteration, bit for bit.
    """
    from storage.lock import RunLock
    from storage.manifest import read_iteration_manifest, read_latest
    from tasks.config import load_config
    from tasks.preflight import preflight
    from tasks.runtime import run_layout, start_run
    from tasks.tracking import open_tracker

    cfg = load_config(config_path, overrides or [])
    preflight(cfg)  # before the run lock: a run that cannot start leaves no run folder
    layout = run_layout(cfg)
    with RunLock(layout, lease_seconds=cfg.storage.lock_lease_seconds, force=force_unlock):
        run = start_run(cfg, layout, allow_config_change=allow_config_change)
        tracker = open_tracker(run)
        stages.prepare_base(cfg.storage.root, cfg.name)
        latest = min(read_latest(layout) or 0, cfg.iterations)
        for n in range(latest + 1):  # what a killed predecessor committed but did not evaluate or log
            complete_iteration(run, tracker, n)
        if latest >= cfg.iterations:
            tracker.finish()
            return None
        metrics, _ = complete_iteration(run, tracker, latest + 1)
        logger.info("iteration %d/%d of %s committed", latest + 1, cfg.iterations, cfg.name)
        if latest + 1 == cfg.iterations:
            tracker.finish()
        manifest = read_iteration_manifest(layout, latest + 1)
        return {**manifest.ref, "metrics": metrics}
