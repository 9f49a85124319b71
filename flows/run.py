"""A whole run as a Prefect flow: create or resume it, then iterate and evaluate.

    base model -> evaluate(0) -> for n in next..N: sdpo_iteration(n) [-> evaluate(n)] -> summary
"""

from __future__ import annotations

import logging
import time
from typing import Any

from prefect import flow

from flows.iteration import sdpo_iteration
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


def _eval_due(n: int, *, every: int, last: int) -> bool:
    return n == last or (every > 0 and n % every == 0)


@flow(name="sdpo-run", log_prints=False)
def sdpo_run(
    config_path: str | None = None,
    overrides: list[str] | None = None,
    allow_config_change: bool = False,
    force_unlock: bool = False,
) -> dict[str, Any]:
    """Create or resume the run described by the config; returns a summary of the run."""
    from storage.layout import RunLayout, create_or_open_run
    from storage.lock import RunLock
    from storage.manifest import read_latest
    from storage.urls import register_options
    from tasks.config import load_config, to_dict
    from tasks.preflight import preflight
    from tasks.runtime import open_run
    from tasks.summary import RunSummary
    from tasks.tracking import Tracker

    cfg = load_config(config_path, overrides or [])
    preflight(cfg)  # before the run lock: a run that cannot start leaves no run folder
    register_options(cfg.storage.root, cfg.storage.storage_options)
    layout = RunLayout(cfg.storage.root, cfg.name)
    root, name = cfg.storage.root, cfg.name
    with RunLock(layout, lease_seconds=cfg.storage.lock_lease_seconds, force=force_unlock) as lock:
        create_or_open_run(layout, to_dict(cfg), allow_config_change=allow_config_change)
        run = open_run(root, name)
        tracker = Tracker(cfg, layout.run_url, local_run_dir=layout.local_dir)
        summary = RunSummary(run_url=layout.run_url, tracking_uri=tracker.uri)

        started = time.perf_counter()
        base_info = stages.prepare_base(root, name)
        summary.base_info = base_info
        summary.before = stages.evaluate(root, name, 0)
        tracker.log_metrics(summary.before, step=0)

        first = (read_latest(layout) or 0) + 1
        for n in range(first, cfg.iterations + 1):
            manifest = sdpo_iteration(root, name, n)
            metrics = dict(manifest["metrics"])
            if _eval_due(n, every=cfg.eval.every, last=cfg.iterations):
                metrics.update(stages.evaluate(root, name, n))
            tracker.log_metrics(metrics, step=n)
            summary.add_iteration(n, metrics)
            logger.info(describe_iteration(n, cfg.iterations, metrics))
            lock.renew()
        summary.after = stages.evaluate(root, name, cfg.iterations)
        summary.seconds = time.perf_counter() - started
        summary.write_artifacts(run, tracker)
        tracker.finish()
    return summary.as_dict()
