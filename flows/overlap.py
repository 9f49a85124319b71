"""Pipelined commits in the flow: iteration n+1 samples and scores while iteration n's train stage
writes its checkpoints and commits.

    rollout(n) -> teacher(n) -> [iteration n-1 done: its eval when due, MLflow, artifacts] -> train(n) ~~> commit(n)
                                                                        (beside rollout(n+1), teacher(n+1))

Iteration n's train and commit task runs go, in that order, to a thread of the flow (with the flow
run's context, so they are task runs of the flow run like the others), each manifest recorded in
the run's tracking record as it returns, as the sequential loop records them. The train stage
hands its weights to the next stages of this process (`tasks.handover`) once the optimizer has
stepped, and goes on writing while the flow starts iteration n+1. Iteration n is completed
(evaluated when due, logged, published) once its commit is done, before iteration n+1 trains.
What every stage commits is what the sequential loop commits, byte for byte: the next stages wait
for commit(n) before their own manifests, and train(n+1) starts after it.

On with `launch.overlap_commits` when every stage that reads checkpoints runs in this process
(in-process rollout, teacher and train launchers) with weights it can take from memory (the
embedded rollout engine: SGLang servers load checkpoints from folders) and the run is on-policy
(`pipeline.max_staleness` 0, whose prefetching process reads the store). The last iteration
trains and commits before the run ends.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from flows.iteration import complete_iteration
from tasks import handover, stages

logger = logging.getLogger(__name__)


def overlap_enabled(cfg: Any) -> bool:
    """Whether `cfg`'s iterations may overlap their commits (see the module doc)."""
    launchers = {getattr(cfg.launch, stage).launcher for stage in ("rollout", "teacher", "train")}
    return (
        bool(cfg.launch.overlap_commits)
        and launchers == {"inprocess"}
        and cfg.rollout.engine == "embedded"
        and cfg.pipeline.max_staleness == 0
    )


class CommitOverlap:
    """Brings a run's iterations to done in order, each one's train stage and commit running while
    the next one samples and scores. A context manager: leaving it waits for the commit in flight
    (the run lock is never released while a commit writes)."""

    def __init__(self, run: Any, tracker: Any) -> None:
        self.run = run
        self.tracker = tracker
        self.enabled = overlap_enabled(run.cfg)
        self.pending: tuple[int, Future[Any]] | None = None  # (iteration, its commit's future)
        self.thread = ThreadPoolExecutor(1, "train-and-commit")

    def __enter__(self) -> CommitOverlap:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pending is not None:
            n, future = self.pending
            self.pending = None
            future.exception()  # whatever happened here, the commit in flight ends before the flow does
            handover.close(self.run.url, n)
        self.thread.shutdown(wait=True)

    def _record(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self.tracker.anchor.record(manifest)
        return manifest

    def advance(self, n: int, prefetch: Any = None) -> list[tuple[int, dict[str, float]]]:
        """Take the run through iteration n; returns the iterations completed by this call, in
        order, with their step metrics (n-1's while n is still committing; none or both at the end)."""
        cfg, layout = self.run.cfg, self.run.layout
        if not self.enabled:
            return [(n, complete_iteration(self.run, self.tracker, n, prefetch)[0])]
        from storage.manifest import read_latest

        if n == 0 or (read_latest(layout) or 0) >= n:
            return [*self.drain(), (n, complete_iteration(self.run, self.tracker, n)[0])]
        root, name = layout.root_url, layout.run_name
        launch = cfg.launch.model_dump(mode="json")
        rollout = self._record(stages.rollout(root, name, n, launch["rollout"]))
        teacher = self._record(stages.teacher(root, name, n, rollout, launch["teacher"]))
        done = self.drain()  # iteration n-1 committed while n sampled and scored

        def train_and_commit() -> dict[str, Any]:
            trained = self._record(stages.train(root, name, n, teacher, launch["train"]))
            return self._record(stages.commit(root, name, n, [rollout, teacher, trained]))

        if n == cfg.iterations:  # nothing follows to overlap with
            train_and_commit()
            return [*done, (n, complete_iteration(self.run, self.tracker, n, trained=True)[0])]
        slot = handover.open_slot(self.run.url, n)
        # the flow run's context goes with the task runs to the thread
        self.pending = (n, self.thread.submit(contextvars.copy_context().run, _failing_slot(slot, train_and_commit)))
        return done

    def drain(self) -> list[tuple[int, dict[str, float]]]:
        """Complete the iteration whose commit is in flight, once it is committed (raises what
        stopped it); nothing when none is."""
        if self.pending is None:
            return []
        n, future = self.pending
        self.pending = None
        try:
            future.result()
        finally:
            handover.close(self.run.url, n)
        return [(n, complete_iteration(self.run, self.tracker, n, trained=True)[0])]


def _failing_slot(slot: handover.Slot, body: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """`body`, whose failure also reaches the slot's waiters (the next iteration's stages), then is raised."""

    def run() -> dict[str, Any]:
        try:
            return body()
        except BaseException as error:  # noqa: BLE001 -- handed to the waiting stages, then raised again
            slot.fail(error)
            raise

    return run
