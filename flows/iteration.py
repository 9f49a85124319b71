"""One SDPO iteration as four Prefect task runs: rollout -> feedback + teacher prefill -> train -> commit.

Each stage skips itself when its manifest already exists, so re-running a failed or killed
iteration resumes at the first stage without one. `complete_iteration` brings an iteration all
the way to done (committed, evaluated when due, its step in MLflow, its Prefect artifacts); both
the whole-run flow and the scheduled one-iteration flow advance a run through it, so they leave
the same run behind.

The scheduled flow `sdpo-advance` ends without a red run when it has nothing to do: Completed, named
`<run>/skipped` with a message starting "Skipped:", once the run is finished (pausing its
deployment's schedules, their parameters kept), Cancelled when another live writer holds the run.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from prefect import flow

from flows.cancel import cancellable
from flows.orchestration import (
    cancelled,
    iteration_run_name,
    logs_to_flow_run,
    name_flow_run,
    name_overlapped_ticks,
    pause_own_schedules,
    quiet_libraries,
    skipped,
    skipped_run_name,
    stood_aside_run_name,
)
from tasks import stages
from tasks.allocator import keep_freed_heap

logger = logging.getLogger(__name__)


def sdpo_iteration(
    root: str,
    run: str,
    iteration: int,
    launch: dict[str, Any] | None = None,
    record: Callable[[dict[str, Any]], None] = lambda ref: None,
) -> dict[str, Any]:
    """Advance run `run` under `root` by iteration `iteration`; returns the iteration manifest.

    `launch` maps a stage to where it runs (`tasks.config.LaunchConfig` as a dict); absent: in this process.
    `record` takes each manifest a stage hands on, as it ends (the run's tracking record keeps its digest).
    The four stages are task runs of the calling flow run, named `<run>/iter-NNNN/<stage>`; a
    subflow of their own would add a flow run's orchestration (about 0.25 s on the local server)
    to every iteration and change nothing they commit.
    """
    launch = launch or {}
    rollout = stages.rollout(root, run, iteration, launch.get("rollout"))
    record(rollout)
    teacher = stages.teacher(root, run, iteration, rollout, launch.get("teacher"))
    record(teacher)
    trained = stages.train(root, run, iteration, teacher, launch.get("train"))
    record(trained)
    committed = stages.commit(root, run, iteration, [rollout, teacher, trained])
    record(committed)
    return committed


def eval_due(n: int, *, enabled: bool, every: int, last: int) -> bool:
    """The base model, the last iteration and every `every`-th are evaluated; none when disabled."""
    return enabled and (n == 0 or n == last or (every > 0 and n % every == 0))


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


class Prefetch:
    """The rollout and teacher prefill of the next `pipeline.max_staleness` iterations, run in a
    worker process (Prefect's `ProcessPoolTaskRunner`, one worker kept for the whole flow run) while
    the flow's process trains the current iteration; nothing with k = 0.

    Iteration m samples from checkpoint m-1-k (`tasks.runtime.behaviour_iteration`), which is
    committed before iteration m-k trains, so m's first two stages can run during that training.
    They run in iteration order and are waited for before the flow moves on: what they commit is
    what they would have committed run one after the other, so a restart resumes them like any
    stage. A process of its own, rather than a thread, gives the training and the sampling a core
    each (no shared interpreter lock) and keeps its imports and its rollout engine warm across
    iterations. A context manager: the worker goes when the block ends.
    """

    def __init__(self, run: Any) -> None:
        self.run = run
        self.futures: dict[int, Any] = {}
        self.tail: Any = None
        self.runner: Any = None

    def __enter__(self) -> Prefetch:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.runner is not None:
            if exc[0] is not None:  # interrupted (cancelled in Prefect, Ctrl-C, a failure): the stages
                # running ahead end now, not when done (their stage processes follow their starter)
                import multiprocessing

                for worker in multiprocessing.active_children():  # the pool's one worker process
                    worker.terminate()
            self.runner.__exit__(*exc)
            self.runner = None

    def _pool(self) -> Any:
        if self.runner is None:
            import json
            import os

            from prefect.task_runners import ProcessPoolTaskRunner

            from storage.urls import registered_options
            from tasks.launch import OPTIONS_ENV

            options = registered_options(self.run.layout.root_url)
            if options:  # no credentials: the config refuses them
                os.environ[OPTIONS_ENV] = json.dumps(dict(options))
            self.runner = ProcessPoolTaskRunner(max_workers=1).__enter__()
        return self.runner

    def ahead_of(self, n: int) -> None:
        """Submit iterations n+1 .. n+k whose teacher stage is not committed."""
        from storage.manifest import stage_done

        cfg, layout = self.run.cfg, self.run.layout
        launch = cfg.launch.model_dump(mode="json")
        for m in range(n + 1, min(n + cfg.pipeline.max_staleness, cfg.iterations) + 1):
            if m in self.futures or stage_done(layout, m, "teacher"):
                continue
            parameters = {"root": layout.root_url, "run": layout.run_name, "iteration": m, "launch": launch}
            after = None if self.tail is None else [self.tail]
            self.tail = self.futures[m] = self._pool().submit(stages.prefetch, parameters=parameters, wait_for=after)

    def wait(self) -> None:
        """Block until every submitted stage is committed; raises the first failure."""
        for m in sorted(self.futures):
            self.futures.pop(m).result()
        self.tail = None


def complete_iteration(
    run: Any, tracker: Any, n: int, prefetch: Prefetch | None = None, *, trained: bool = False
) -> tuple[dict[str, float], bool]:
    """Iteration n of `run` done: committed (n > 0), evaluated when due, logged to MLflow once,
    and the checkpoints retention does not keep pruned. With `prefetch`, the rollout and teacher
    prefill of the next `pipeline.max_staleness` iterations run while iteration n trains;
    `trained`: the caller ran and committed iteration n's stages (`flows.overlap`).

    Returns (the step's metrics, whether this call trained the iteration). Everything is read back
    from the store, so a call after a crash finishes what the crashed process left undone. An
    iteration trained or first logged by this call, or whose sample table MLflow does not have yet,
    also gets its status line, its sample table in MLflow and its Prefect artifacts.
    """
    from flows.artifacts import publish_iteration
    from storage.adopt import adopt_stage
    from storage.fork import forked_at
    from storage.manifest import read_iteration_manifest, read_latest, read_stage_manifest, stage_done
    from tasks.runtime import retain_after_commit
    from tasks.tracking.summary import sample_table

    cfg, root, name = run.cfg, run.layout.root_url, run.layout.run_name
    launch = cfg.launch.model_dump(mode="json")
    ran = trained
    metrics: dict[str, float] = {}
    if n > 0:
        if not trained and (read_latest(run.layout) or 0) < n:
            if prefetch is not None:  # iteration n's own stages ran ahead and were waited for last call
                prefetch.ahead_of(n)
            sdpo_iteration(root, name, n, launch, record=tracker.anchor.record)
            if prefetch is not None:
                prefetch.wait()
            ran = True
        metrics.update(read_iteration_manifest(run.layout, n).data["metrics"])
    if eval_due(n, enabled=cfg.eval.enabled, every=cfg.eval.every, last=cfg.iterations):
        if stage_done(run.layout, n, "eval"):  # committed by an earlier attempt: checked before it is reused
            metrics.update(adopt_stage(run.layout, n, "eval", hash_files=cfg.storage.verify_sha256)["metrics"])
        else:
            tracker.anchor.computing(run.layout.relative(run.layout.stage_manifest(n, "eval")))
            metrics.update(stages.evaluate(root, name, n, launch["eval"]))
            tracker.anchor.record(read_stage_manifest(run.layout, n, "eval").ref)
    logged = tracker.log_step(n, metrics)
    # a kill after the step's metrics and before its sample table leaves the table to this call
    if n > 0 and (ran or logged or not tracker.has_samples(n)):
        samples = sample_table(run, n)
        tracker.log_samples(n, samples)
        if ran or n > forked_at(run.layout):  # a fork's first iterations are its parent's: no news here
            logger.info("%s: %s", name, describe_iteration(n, cfg.iterations, metrics))
            publish_iteration(run, tracker, n, metrics, samples)
    if ran or n == cfg.iterations:
        retain_after_commit(run)
    return metrics, ran


def finish_run(run: Any, tracker: Any, summary: Any) -> None:
    """The end of a complete run: its MLflow artifacts and models, its Prefect summary, the MLflow
    run closed, and last the summary in the store, which marks the run finished (`storage.summary`):
    a later flow run of the same run publishes nothing again."""
    from flows.artifacts import publish_run
    from storage.summary import write_run_summary
    from tasks.tracking.assets import log_policies

    summary.write_artifacts(run, tracker)
    log_policies(run=run, tracker=tracker)
    publish_run(run, tracker, summary.as_dict())
    tracker.finish()
    write_run_summary(run.layout, run.cfg.iterations, summary.as_dict())


def finished_reason(cfg: Any, layout: Any) -> str | None:
    """Why a flow run of run `cfg.name` has nothing to do (the run is finished for its configured
    iterations: `storage.summary`), or None when there is work left."""
    from storage.summary import finished_summary

    record = finished_summary(layout, cfg.iterations)
    if record is None:
        return None
    return (
        f"run {cfg.name} is complete ({cfg.iterations} iterations; its summary was published at "
        f"{record['written_at']}); nothing to do"
    )


@contextlib.contextmanager
def writer_or_cancelled(cfg: Any, layout: Any, *, force_unlock: bool) -> Iterator[Any]:
    """Hold the run lock for the block, which gets None; or, when another live writer holds it,
    hold nothing and give the block the Cancelled state that names that writer. A stale lock this
    flow may not take over (no `force_unlock`) raises: someone has to look."""
    from storage.errors import LockHeldError
    from storage.lock import RunLock, read_lock_holder

    lease = cfg.storage.lock_lease_seconds
    lock = RunLock(layout, lease_seconds=lease, force=force_unlock, heartbeat_seconds=lease / 4)
    try:
        lock.acquire()
    except LockHeldError:
        holder = read_lock_holder(layout)
        if holder is None or holder.stale_reason() is not None:
            raise
        aside: str | None = f"run {cfg.name} is being written by {holder.describe()}; this flow run stands aside"
    else:
        aside = None
    if aside is not None:
        name_flow_run(stood_aside_run_name(cfg.name))
        yield cancelled(aside)
        return
    try:
        yield None
    finally:
        lock.release()


@flow(name="sdpo-advance", log_prints=False)
@logs_to_flow_run
@cancellable
def sdpo_advance(
    config_path: str,
    overrides: list[str] | None = None,
    allow_config_change: bool = False,
    force_unlock: bool = False,
) -> dict[str, Any] | None:
    """Run the next iteration of the configured run (for scheduled deployments).

    Creates the run when it does not exist. One flow run, one iteration, one process: what it
    leaves is what `sdpo run` leaves after the same iteration, bit for bit. Returns the committed
    iteration's manifest reference and metrics; once the run is finished, ends Completed with a
    "Skipped:" message (None), pausing the schedules of the deployment it runs from (their
    parameters kept); Cancelled when another live writer holds the run lock.

    Args:
        config_path: YAML run config (relative to the working directory, SDPO_REPO_DIR on a worker).
        overrides: dotted overrides applied on top of the config, e.g. ["loss.alpha=1", "iterations=6"].
        allow_config_change: continue an existing run under a changed config (recorded in the run and in MLflow).
        force_unlock: take over a run lock whose lease expired and whose holder did not heartbeat.
    """
    from tasks.config import load_config, refuse_flow_overrides
    from tasks.preflight import preflight
    from tasks.runtime import run_layout

    quiet_libraries()
    keep_freed_heap()  # a worker's flow run does not start in the CLI's main()
    cfg = load_config(config_path, overrides or [])
    # started from a deployment, the CLI's check of what Prefect stores did not run
    refuse_flow_overrides(overrides or [], config_path=config_path)
    preflight(cfg)  # before the run lock: a run that cannot start leaves no run folder
    layout = run_layout(cfg)
    with writer_or_cancelled(cfg, layout, force_unlock=force_unlock) as stood_aside:
        if stood_aside is not None:
            return stood_aside
        advanced = _advance_locked(cfg, layout, allow_config_change=allow_config_change)
        name_overlapped_ticks(cfg.name)  # the ticks Prefect cancelled while this one (or an earlier one) ran
        return advanced


def _advance_locked(cfg: Any, layout: Any, *, allow_config_change: bool) -> Any:
    """The body of `sdpo_advance`, holding the run lock."""
    from storage.manifest import read_iteration_manifest, read_latest
    from tasks.runtime import start_run
    from tasks.tracking.experiment import open_tracker
    from tasks.tracking.summary import RunSummary

    run = start_run(cfg, layout, allow_config_change=allow_config_change)
    if (finished := _skip_finished(cfg, layout)) is not None:
        return finished
    latest = min(read_latest(layout) or 0, cfg.iterations)
    complete = latest >= cfg.iterations
    name_flow_run(f"{cfg.name}/complete" if complete else iteration_run_name(cfg.name, latest + 1))
    tracker = open_tracker(run)
    summary = RunSummary(
        run_url=layout.run_url, tracking_uri=tracker.uri, loss_type=cfg.loss.type, experiment_id=tracker.experiment_id
    )
    summary.base_info = stages.prepare_base(cfg.storage.root, cfg.name)
    # the flow run that ends the run writes its summary, which needs every step's metrics
    ends_run = latest + 1 >= cfg.iterations
    for n in range(latest + 1):  # what a killed predecessor committed but did not evaluate or log
        # a step MLflow holds with its sample table was committed, evaluated and logged: nothing is
        # left to do, and reading it back (a few store requests a step) is only for the summary
        if not ends_run and tracker.published(n):
            continue
        summary.record(n, complete_iteration(run, tracker, n)[0])
    if complete:  # a predecessor committed the last iteration and was killed before the summary
        summary.close(cfg.iterations)
        finish_run(run, tracker, summary)
        return _skip_finished(cfg, layout)
    with tracker.system_metrics():
        # one iteration per process: a worker process to run the next one's stages ahead would cost
        # more to start than it saves; the staleness, and so every committed byte, is the same
        metrics, _ = complete_iteration(run, tracker, latest + 1)
    summary.record(latest + 1, metrics)
    if latest + 1 == cfg.iterations:
        summary.close(cfg.iterations)
        finish_run(run, tracker, summary)
    manifest = read_iteration_manifest(layout, latest + 1)
    return {**manifest.ref, "metrics": metrics}


def _skip_finished(cfg: Any, layout: Any) -> Any:
    """For a finished run: the flow run named `<run>/skipped`, the deployment's schedules paused,
    and its Skipped state; None when there is work left."""
    reason = finished_reason(cfg, layout)
    if reason is None:
        return None
    name_flow_run(skipped_run_name(cfg.name))
    paused = pause_own_schedules(reason)
    return skipped(f"{reason}; {paused}" if paused else reason)
