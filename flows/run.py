"""A whole run as a Prefect flow: create or resume it, then bring every iteration to done.

base model -> for n in 0..N: complete_iteration(n)  [iteration n, its evaluation when due,
                                                      its MLflow step, its Prefect artifacts;
                                                      its commit beside n+1's rollout: flows/overlap.py]
           -> summary (MLflow artifacts, the Prefect run summary, then the store's record)

A flow run that finds the run finished (a second request queued behind the one that finished it)
ends Completed with a "Skipped:" message, named `<run>/skipped`, and publishes nothing; one that
finds another live writer holding the run ends Cancelled, naming it; one the CLI runs that is
cancelled in Prefect stops within seconds and ends Cancelled (`flows.cancel`).
"""

from __future__ import annotations

import logging
from typing import Any

from prefect import flow

from flows.cancel import cancellable
from flows.iteration import Prefetch, finish_run, finished_reason, writer_or_cancelled
from flows.orchestration import logs_to_flow_run, name_flow_run, quiet_libraries, skipped, skipped_run_name
from flows.overlap import CommitOverlap
from tasks import stages
from tasks.allocator import keep_freed_heap

logger = logging.getLogger(__name__)


def import_libraries(cfg: Any) -> None:
    """Import what a run of `cfg` will import in this process, frozen out of the collector's way
    (`tasks.preload`): the libraries of the stages it keeps here and MLflow when tracking. The CLI
    calls it while Prefect's ephemeral server starts."""
    from tasks.preload import import_frozen, stage_imports

    import_frozen(stage_imports(cfg) + (["mlflow"] if cfg.tracking.enabled else []))


@flow(name="sdpo-run", log_prints=False)
@logs_to_flow_run
@cancellable
def sdpo_run(
    config_path: str | None = None,
    overrides: list[str] | None = None,
    allow_config_change: bool = False,
    force_unlock: bool = False,
) -> Any:
    """Create or resume the run described by the config and iterate it to its last iteration.

    Args:
        config_path: YAML run config (relative to the working directory, SDPO_REPO_DIR on a worker).
        overrides: dotted overrides applied on top of the config, e.g. ["loss.alpha=1", "iterations=6"].
        allow_config_change: continue an existing run under a changed config (recorded in the run and in MLflow).
        force_unlock: take over a run lock whose lease expired and whose holder did not heartbeat.

    Returns:
        The run summary: accuracy before and after, per-iteration metrics, time per stage; or the
        Skipped state (a finished run) or the Cancelled one (another live writer holds the run).
    """
    from storage.manifest import read_latest
    from tasks.config import load_config, refuse_flow_overrides
    from tasks.preflight import preflight
    from tasks.runtime import run_layout, start_run
    from tasks.tracking.experiment import open_tracker
    from tasks.tracking.summary import RunSummary

    quiet_libraries()
    keep_freed_heap()  # a worker's flow run does not start in the CLI's main()
    cfg = load_config(config_path, overrides or [])
    # started from a deployment, the CLI's check of what Prefect stores did not run
    refuse_flow_overrides(overrides or [], config_path=config_path)
    preflight(cfg)  # before the run lock: a run that cannot start leaves no run folder
    layout = run_layout(cfg)
    name_flow_run(f"{cfg.name}/run-to-{cfg.iterations:04d}")
    with writer_or_cancelled(cfg, layout, force_unlock=force_unlock) as stood_aside:
        if stood_aside is not None:
            return stood_aside
        run = start_run(cfg, layout, allow_config_change=allow_config_change)
        if (reason := finished_reason(cfg, layout)) is not None:
            name_flow_run(skipped_run_name(cfg.name))
            return skipped(reason)
        tracker = open_tracker(run)
        summary = RunSummary(
            run_url=layout.run_url,
            tracking_uri=tracker.uri,
            loss_type=cfg.loss.type,
            experiment_id=tracker.experiment_id,
        )

        with tracker.system_metrics():
            summary.base_info = stages.prepare_base(cfg.storage.root, cfg.name)
            # with pipeline.max_staleness k: the next k rollouts during training; else, with
            # launch.overlap_commits, each iteration's commit beside the next one's rollout
            with Prefetch(run) as prefetch, CommitOverlap(run, tracker) as iterations:
                for n in range(cfg.iterations + 1):
                    for done, metrics in iterations.advance(n, prefetch):
                        summary.record(done, metrics)
        latest = read_latest(layout)
        if latest is None or latest < cfg.iterations:
            raise RuntimeError(f"run {cfg.name!r} ended with LATEST = {latest}, expected {cfg.iterations}")
        summary.close(cfg.iterations)
        finish_run(run, tracker, summary)
    return summary.as_dict()
