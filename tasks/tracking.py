"""MLflow tracking: one MLflow run per SDPO run, metrics per iteration, artifacts at the end.

The tracking URI comes from the config; unset, it is a SQLite file beside the run (local runs) or
under `.sdpo/` (object-store runs). Metrics are logged in batches.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from tasks.config import RunConfig, flatten, to_dict

logger = logging.getLogger(__name__)

RUN_URL_TAG = "sdpo.run_url"


def tracking_uri(cfg: RunConfig, run_url: str, *, local_run_dir: Path | None) -> str:
    if cfg.tracking.uri:
        return cfg.tracking.uri
    base = local_run_dir if local_run_dir is not None else Path(".sdpo")
    base.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(base / 'mlflow.db').resolve()}"


class Tracker:
    """Logs one SDPO run; resumes the same MLflow run when the SDPO run resumes."""

    def __init__(self, cfg: RunConfig, run_url: str, *, local_run_dir: Path | None) -> None:
        import mlflow
        from mlflow.tracking import MlflowClient

        self.enabled = cfg.tracking.enabled
        self.uri = tracking_uri(cfg, run_url, local_run_dir=local_run_dir)
        self.run_id: str | None = None
        if not self.enabled:
            return
        mlflow.set_tracking_uri(self.uri)
        self.client = MlflowClient(self.uri)
        experiment = self.client.get_experiment_by_name(cfg.tracking.experiment)
        if experiment is None:
            artifact_location = None
            if self.uri.startswith("sqlite:///"):
                db = Path(self.uri.removeprefix("sqlite:///"))
                artifact_location = (db.parent / "mlartifacts").resolve().as_uri()
            experiment_id = self.client.create_experiment(cfg.tracking.experiment, artifact_location=artifact_location)
        else:
            experiment_id = experiment.experiment_id
        existing = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`{RUN_URL_TAG}` = '{run_url}'", max_results=1
        )
        if existing:
            self.run_id = existing[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            run = self.client.create_run(experiment_id, run_name=cfg.name, tags={RUN_URL_TAG: run_url})
            self.run_id = run.info.run_id
            self.log_params(flatten(to_dict(cfg)))

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        if not self.enabled:
            return
        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], *, step: int) -> None:
        from mlflow.entities import Metric

        if not self.enabled or not metrics:
            return
        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(items), 500):
            self.client.log_batch(self.run_id, metrics=items[i : i + 500])

    def set_tags(self, tags: dict[str, str]) -> None:
        if not self.enabled:
            return
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, value)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        if not self.enabled:
            return
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def finish(self, status: str = "FINISHED") -> None:
        if not self.enabled:
            return
        self.client.set_terminated(self.run_id, status=status)
