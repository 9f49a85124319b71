"""The evaluation flow: held-out accuracy of one checkpoint of a run."""

from __future__ import annotations

from prefect import flow

from flows.orchestration import name_flow_run, quiet_libraries
from tasks import stages


@flow(name="sdpo-eval", log_prints=False)
def sdpo_eval(config_path: str, overrides: list[str] | None = None, iteration: int = -1) -> dict[str, float]:
    """Evaluate checkpoint `iteration` of the configured run (-1 = LATEST)."""
    from storage.layout import RunLayout
    from storage.manifest import read_latest
    from storage.urls import register_options
    from tasks.config import load_config, refuse_flow_overrides

    quiet_libraries()
    cfg = load_config(config_path, overrides or [])
    # started from a deployment, the CLI's check of what Prefect stores did not run
    refuse_flow_overrides(overrides or [], config_path=config_path)
    register_options(cfg.storage.root, cfg.storage.storage_options.as_fsspec())
    layout = RunLayout(cfg.storage.root, cfg.name)
    n = (read_latest(layout) or 0) if iteration < 0 else iteration
    name_flow_run(f"{cfg.name}/eval-{n:04d}")
    return stages.evaluate(cfg.storage.root, cfg.name, n)
