"""MLflow tracking: one MLflow run per SDPO run, metrics per iteration, artifacts at the end.

The tracking URI comes from the config; unset, it is a SQLite file beside the run (local runs) or
under `.sdpo/` (object-store runs).

Tracking follows the store, never the other way round: step n's metrics are read from iteration
n's committed manifests (and its committed evaluation) and logged in one batch together with the
marker metric `tracking/step`. A step whose marker is in MLflow is never logged again, and a step
committed but not yet logged (a kill between commit and logging) is logged on the next start, so
every step appears exactly once however often the run was killed and resumed.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from tasks.config import RunConfig, flatten, to_dict

logger = logging.getLogger(__name__)

RUN_URL_TAG = "sdpo.run_url"
STEP_MARKER = "tracking/step"  # logged last in each step's batch: the step is in MLflow
CHANGES_TAG = "sdpo.config_changes"  # how many accepted config changes are recorded as tags
_BATCH_LIMIT = 1000  # MLflow's limit on metrics per log_batch


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
        # Idempotent: a kill between creating the run and logging its params is mended here.
        self.log_params(flatten(to_dict(cfg)))
        history = self.client.get_metric_history(self.run_id, STEP_MARKER)
        self.logged_steps: set[int] = {int(m.step) for m in history}

    def log_params(self, params: dict[str, Any]) -> None:
        """Log the params MLflow does not have yet. MLflow params are immutable: a param whose value
        changed (an accepted config change) keeps its first value; `record_config_changes` tags it."""
        from mlflow.entities import Param

        if not self.enabled:
            return
        have = self.client.get_run(self.run_id).data.params
        items = [Param(k, str(v)[:6000]) for k, v in params.items() if k not in have]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log_step(self, step: int, metrics: dict[str, float]) -> bool:
        """Log step `step`'s metrics once: False (nothing logged) when MLflow already has the step."""
        from mlflow.entities import Metric

        from storage.faults import crash_point

        if not self.enabled or step in self.logged_steps:
            return False
        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in sorted(metrics.items())]
        items.append(Metric(STEP_MARKER, float(step), now, step))
        # One batch is one transaction; only a step of over 999 metrics takes several, marker last.
        for i in range(0, len(items), _BATCH_LIMIT):
            self.client.log_batch(self.run_id, metrics=items[i : i + _BATCH_LIMIT])
        self.logged_steps.add(step)
        crash_point("tracking.logged", step)
        return True

    def record_config_changes(self, changes: list[dict[str, Any]]) -> None:
        """Tag each accepted config change (`config_changes.jsonl` entries) once, with its diff:
        `sdpo.config_change.<i>` = "<time>: key: old -> new; ...", and log the params it added."""
        if not self.enabled:
            return
        recorded = int(self.client.get_run(self.run_id).data.tags.get(CHANGES_TAG, "0"))
        for i, change in enumerate(changes[recorded:], start=recorded + 1):
            diff = "; ".join(f"{d['key']}: {d['old']!r} -> {d['new']!r}" for d in change["diff"])
            self.client.set_tag(self.run_id, f"sdpo.config_change.{i}", f"{change['changed_at']}: {diff}"[:5000])
            self.log_params({d["key"]: d["new"] for d in change["diff"]})
            self.client.set_tag(self.run_id, CHANGES_TAG, str(i))

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


def open_tracker(run: Any) -> Tracker:
    """The MLflow run of SDPO run `run` (created or resumed), with its accepted config changes tagged."""
    from storage.layout import read_config_changes

    tracker = Tracker(run.cfg, run.layout.run_url, local_run_dir=run.layout.local_dir)
    tracker.record_config_changes(read_config_changes(run.layout))
    return tracker
