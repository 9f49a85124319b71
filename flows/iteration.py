"""One SDPO iteration as a Prefect flow: rollout -> feedback + teacher prefill -> train -> commit.

Each stage skips itself when its manifest already exists, so re-running a failed or killed
iteration resumes at the first stage without one.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from tasks import stages


@flow(name="sdpo-iteration", log_prints=False)
def sdpo_iteration(root: str, run: str, iteration: int) -> dict[str, Any]:
    """Advance run `run` under `root` by iteration `iteration`; returns the iteration manifest."""
    rollout = stages.rollout(root, run, iteration)
    teacher = stages.teacher(root, run, iteration, rollout)
    trained = stages.train(root, run, iteration, teacher)
    return stages.commit(root, run, iteration, [rollout, teacher, trained])


@flow(name="sdpo-advance", log_prints=False)
def sdpo_advance(config_path: str, overrides: list[str] | None = None) -> dict[str, Any] | None:
    """Run the next iteration of the configured run (for scheduled deployments); None when done.

    The run must exist (created by `sdpo run` or the `sdpo-run` flow); its base model and frozen
    config are read from the store.
    """
    from storage.layout import RunLayout, create_or_open_run
    from storage.lock import RunLock
    from storage.manifest import read_latest
    from storage.urls import register_options
    from tasks.config import load_config, to_dict

    cfg = load_config(config_path, overrides or [])
    register_options(cfg.storage.root, cfg.storage.storage_options)
    layout = RunLayout(cfg.storage.root, cfg.name)
    with RunLock(layout, lease_seconds=cfg.storage.lock_lease_seconds):
        create_or_open_run(layout, to_dict(cfg))
        stages.prepare_base(cfg.storage.root, cfg.name)
        latest = read_latest(layout) or 0
        if latest >= cfg.iterations:
            return None
        return sdpo_iteration(cfg.storage.root, cfg.name, latest + 1)
