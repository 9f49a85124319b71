"""One SDPO iteration as a Prefect flow: rollout -> feedback + teacher prefill -> train -> commit.

Each stage skips itself when its manifest already exists, so re-running a failed or killed
iteration resumes at the first stage without one.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from tasks import stages


@flow(name="sdpo-iteration", log_prints=False)
def sdpo_iteration(root: str, run: str, iteration: int, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Advance run `run` under `root` by iteration `iteration`; returns the iteration manifest."""
    opts = storage_options or {}
    rollout = stages.rollout(root, run, iteration, opts)
    teacher = stages.teacher(root, run, iteration, opts, rollout)
    trained = stages.train(root, run, iteration, opts, teacher)
    return stages.commit(root, run, iteration, opts, [rollout, teacher, trained])


@flow(name="sdpo-advance", log_prints=False)
def sdpo_advance(root: str, run: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Run the next iteration of an existing run (for scheduled deployments); None when it is done."""
    from storage.lock import RunLock
    from tasks.runtime import open_run

    handle = open_run(root, run, storage_options)
    with RunLock(handle.layout, lease_seconds=handle.cfg.storage.lock_lease_seconds):
        from storage.manifest import read_latest

        latest = read_latest(handle.layout) or 0
        if latest >= handle.cfg.iterations:
            return None
        return sdpo_iteration(root, run, latest + 1, storage_options)
