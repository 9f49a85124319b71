"""A whole run as a Prefect flow: create or resume it, then bring every iteration to done.

    base model -> for n in 0..N: complete_iteration(n)  [iteration n, its evaluation when due,
                                                          its MLflow step]  -> summary
"""

from __future__ import annotations

import logging
import time
from typing import Any

from prefect import flow

from flows.iteration import complete_iteration
from tasks import stages

logger = logging.getLogger(__name__)


def describe_iteration(n: int, total: int, metrics: dict[str, float]) -> str:
    """One status line: reward, loss, teacher coverage, eval accuracy when measured, stage times."""
    parts = [f"iteration {n}/{total}", f"reward {metrics.get('rollout/reward_mean', float('nan')):.3f}"]
    if "loss/total" in metrics:
        parts.append(f"loss {metrics['loss/total']:.4f}")
    if "sdpo/sample_mask_fraction" in metrics:
        parts.append(f"teacher signal on {metrics['sdpo/sample_mask_fraction']:.0%} of samples")
    if "eval/greedy_accuracy" in metrics:
        parts.append(f"eval greedy acc {metrics['eval/greedy_accuracy']:.3f}")
    seconds = sum(metrics.get(f"{s}/stage_seconds", 0.0) for s in ("rollout", "teacher", "train"))
    parts.append(f"{seconds:.1f}s")
    return " | ".join(parts)


@flow(name="sdpo-run", log_prints=False)
def sdpo_run(
    config_path: str | None = None,
    overrides: list[str] | None = None,
    allow_config_change: bool = False,
    force_unlock: bool = False,
) -> dict[str, Any]:
    """Create or resume the run described by the config; returns a summary of the run."""
    from storage.lock import RunLock
    from storage.manifest import read_latest
    from tasks.config import load_config
    from tasks.preflight import preflight
    from tasks.runtime import run_layout, start_run
    from tasks.summary import RunSummary
    from tasks.tracking import open_tracker

    cfg = load_config(config_path, overrides or [])
    preflight(cfg)  # before the run lock: a run that cannot start leaves no run folder
    layout = run_layout(cfg)
    with RunLock(layout, lease_seconds=cfg.storage.lock_lease_seconds, force=force_unlock) as lock:
        run = start_run(cfg, layout, allow_config_change=allow_config_change)
        tracker = open_tracker(run)
        summary = RunSummary(run_url=layout.run_url, tracking_uri=tracker.uri)

        started = time.perf_counter()
        summary.base_info = stages.prepare_base(cfg.storage.root, cfg.name)
        for n in range(cfg.iterations + 1):
            metrics, ran = complete_iteration(run, tracker, n)
            if n == 0:
                summary.before = metrics
                continue
            summary.add_iteration(n, metrics)
            if ran:
                logger.info(describe_iteration(n, cfg.iterations, metrics))
            lock.renew()
        latest = read_latest(layout)
        if latest is None or latest < cfg.iterations:
            raise RuntimeError(f"run {cfg.name!r} ended with LATEST = {latest}, expected {cfg.iterations}")
        summary.after = {k: v for k, v in summary.iterations.get(cfg.iterations, summary.before).items() if k.startswith("eval/")}
        summary.seconds = time.perf_counter() - started
        summary.write_artifacts(run, tracker)
        tracker.finish()
    return summary.as_dict()
