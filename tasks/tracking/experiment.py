"""MLflow tracking: one MLflow run per SDPO run, metrics per iteration, artifacts at the end.

The tracking URI comes from the config; unset, it is one SQLite store per storage root, beside the
runs (`<root>/mlflow.db` for a local root, `.sdpo/mlflow.db` for an object-store root), so every
run under a root, its baseline and its forks, compare in one `mlflow ui`. A store moved or copied
with its runs folder has the artifact locations and run URLs it recorded rewritten when it opens
(`tasks.tracking.relocate`).

The loss a run optimises is in its metric names: `loss/total` and `train/loss` of the trainer are
logged as `loss/<type>` and `train/loss_<type>` (`sdpo`, `grpo`, `blend`), so curves of two
different losses are never overlaid under one name.

Tracking follows the store, never the other way round: step n's metrics are read from iteration
n's committed manifests (and its committed evaluation) and logged in one batch together with the
marker metric `tracking/step`. A step whose marker is in MLflow is never logged again, and a step
committed but not yet logged (a kill between commit and logging) is logged on the next start, so
every step appears exactly once however often the run was killed and resumed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from storage.credentials import check_record
from tasks.config import RunConfig, flatten, to_dict
from tasks.tracking.relocate import artifacts_uri, relocate_store

logger = logging.getLogger(__name__)

RUN_URL_TAG = "sdpo.run_url"
VIEW_TAG = "sdpo.view"  # the `sdpo view` command that opens the run's rollouts
PARENT_URL_TAG = "sdpo.parent_run_url"  # a fork's parent run
PARENT_RUN_TAG = "sdpo.parent_mlflow_run_id"  # a fork's parent's MLflow run, when in the same experiment
# The experiment type the MLflow UI (3.x) keeps as this tag and opens the experiment by: training runs
# (the runs table and charts), not the GenAI view of traces. The UI defines both strings; MLflow's
# Python package has no constant for them.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"
# MLflow's UI (3.17) opens a page in the view the browser last chose at the top of its sidebar
# ("GenAI" until the user switches), not by the experiment's kind; a page address carrying this query
# opens in the training view ("Model training"), so the links the pipeline writes carry it.
TRAINING_VIEW = "workflowType=machine_learning"
FORKED_AT_TAG = "sdpo.forked_from_iteration"
STEP_MARKER = "tracking/step"  # logged last in each step's batch: the step is in MLflow
CHANGES_TAG = "sdpo.config_changes"  # how many accepted config changes are recorded as tags
_BATCH_LIMIT = 1000  # MLflow's limit on metrics per log_batch
SAMPLES_DIR = "samples"  # the MLflow run's folder of per-step sample tables
_RUN_NAME_CHARS = 250  # what MLflow's store keeps of a run name
_SOURCE = Path(__file__).resolve().parents[2]  # the checkout (or installed tree) the code runs from


def source_tags() -> dict[str, str]:
    """MLflow's standard source tags: the code that wrote the run, and its git commit and branch
    when it runs from a git checkout."""
    from mlflow.utils.git_utils import get_git_branch, get_git_commit, get_git_repo_url
    from mlflow.utils.mlflow_tags import (
        MLFLOW_GIT_BRANCH,
        MLFLOW_GIT_COMMIT,
        MLFLOW_GIT_REPO_URL,
        MLFLOW_SOURCE_NAME,
        MLFLOW_SOURCE_TYPE,
    )

    tags = {MLFLOW_SOURCE_NAME: str(_SOURCE), MLFLOW_SOURCE_TYPE: "JOB"}
    found = {
        MLFLOW_GIT_COMMIT: get_git_commit(str(_SOURCE)),
        MLFLOW_GIT_BRANCH: get_git_branch(str(_SOURCE)),
        MLFLOW_GIT_REPO_URL: _without_credentials(get_git_repo_url(str(_SOURCE))),
    }
    tags.update({k: v for k, v in found.items() if v})
    return tags


def _without_credentials(url: str | None) -> str | None:
    """A git remote as a record may hold it: without the user (a token in `https://TOKEN@host/...`),
    query or fragment."""
    if url is None or "://" not in url:
        return url
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


def samples_file(step: int) -> str:
    """Where step `step`'s sample table lies among the MLflow run's artifacts."""
    return f"{SAMPLES_DIR}/iter-{step:04d}.json"


def tables_tag(files: Iterable[str]) -> str:
    """The `mlflow.loggedArtifacts` tag for these sample table files: as many of the newest as fit
    in the characters MLflow keeps of a tag value (8,000), oldest first, in `mlflow.log_table`'s
    format. Every table stays among the run's artifacts, where `MlflowClient.load_table` reads any
    of them by name; the tag decides only which ones the UI lists (those of about the last 147
    steps)."""
    from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

    entries: list[dict[str, str]] = []
    length = len("[]")
    for path in sorted(files, key=lambda p: (len(p), p), reverse=True):  # iter-10000 after iter-9999
        entry = {"path": path, "type": "table"}
        length += len(json.dumps(entry)) + (len(", ") if entries else 0)
        if length > MAX_TAG_VAL_LENGTH:
            break
        entries.append(entry)
    return json.dumps(entries[::-1])


def tracking_uri(cfg: RunConfig, *, local_root_dir: Path | None) -> str:
    """The configured URI, else the SQLite store of the storage root (see the module doc)."""
    if cfg.tracking.uri:
        return cfg.tracking.uri
    base = local_root_dir if local_root_dir is not None else Path(".sdpo")
    base.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(base / 'mlflow.db').resolve()}"


def metric_names(metrics: dict[str, float], *, loss_type: str) -> dict[str, float]:
    """The metrics under the names MLflow shows: the trainer's loss totals named by loss type."""
    renamed = {"loss/total": f"loss/{loss_type}", "train/loss": f"train/loss_{loss_type}"}
    return {renamed.get(k, k): v for k, v in metrics.items()}


class Tracker:
    """Logs one SDPO run; resumes the same MLflow run when the SDPO run resumes."""

    anchor: Any = None  # the run's RunAnchor, set by open_tracker

    def __init__(self, cfg: RunConfig, run_url: str, *, local_root_dir: Path | None) -> None:
        import mlflow
        from mlflow.tracking import MlflowClient

        self.enabled = cfg.tracking.enabled
        self.name = cfg.name
        self.uri = tracking_uri(cfg, local_root_dir=local_root_dir)
        self.ui_url = cfg.tracking.ui_url
        self.loss_type = cfg.loss.type
        self.log_system_metrics = cfg.tracking.system_metrics
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        if not self.enabled:
            return
        db = Path(self.uri.removeprefix("sqlite:///")) if self.uri.startswith("sqlite:///") else None
        if db is not None and db.exists():  # moved (or copied) with its runs folder?
            moved = relocate_store(db)
            if moved is not None:
                logger.warning("%s", moved.describe())
        mlflow.set_tracking_uri(self.uri)
        self.client = MlflowClient(self.uri)
        experiment = self.client.get_experiment_by_name(cfg.tracking.experiment)
        if experiment is None:
            artifact_location = None if db is None else artifacts_uri(db)
            experiment_id = self.client.create_experiment(
                cfg.tracking.experiment, artifact_location=artifact_location, tags={EXPERIMENT_KIND_TAG: TRAINING_KIND}
            )
        else:
            experiment_id = experiment.experiment_id
            # an experiment created without its kind (or whose kind the UI only guessed) is given it
            kind = experiment.tags.get(EXPERIMENT_KIND_TAG)
            if kind is None or kind.endswith("_inferred"):
                self.client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, TRAINING_KIND)
        self.experiment_id = experiment_id
        existing = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`{RUN_URL_TAG}` = '{run_url}'", max_results=1
        )
        if existing:
            self.run_id = existing[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            check_record({RUN_URL_TAG: run_url}, record=f"the tags of the MLflow run of {cfg.name}")
            run = self.client.create_run(experiment_id, run_name=cfg.name, tags={RUN_URL_TAG: run_url})
            self.run_id = run.info.run_id
        # Idempotent: a kill between creating the run and logging its params is mended here.
        self.log_params(flatten(to_dict(cfg)))
        self.set_tags(source_tags())
        from tasks.viewer import view_command

        self.set_tags({VIEW_TAG: view_command(cfg.name, cfg.storage.root)})  # how to browse its samples
        history = self.client.get_metric_history(self.run_id, STEP_MARKER)
        self.logged_steps: set[int] = {int(m.step) for m in history}
        self._list_samples()

    def log_params(self, params: dict[str, Any]) -> None:
        """Log the params MLflow does not have yet. MLflow params are immutable: a param whose value
        changed (an accepted config change) keeps its first value; `record_config_changes` tags it."""
        from mlflow.entities import Param

        if not self.enabled:
            return
        check_record(params, record=f"the MLflow params of run {self.run_id}")
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
        named = metric_names(metrics, loss_type=self.loss_type)
        items = [Metric(k, float(v), now, step) for k, v in sorted(named.items())]
        items.append(Metric(STEP_MARKER, float(step), now, step))
        # One batch is one transaction; only a step of over 999 metrics takes several, marker last.
        for i in range(0, len(items), _BATCH_LIMIT):
            self.client.log_batch(self.run_id, metrics=items[i : i + _BATCH_LIMIT])
        self.logged_steps.add(step)
        crash_point("tracking.logged", step)
        return True

    def _list_samples(self) -> None:
        """Learn which steps have their sample table, and mend the tag that lists the tables."""
        from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS

        listed = self.client.list_artifacts(self.run_id, SAMPLES_DIR)
        self.sample_files = {a.path for a in listed if not a.is_dir}
        self._list_tables(self.client.get_run(self.run_id).data.tags.get(MLFLOW_LOGGED_ARTIFACTS))

    def _list_tables(self, current: str | None) -> None:
        """Set the run's `mlflow.loggedArtifacts` tag, by which MLflow's UI finds its tables, to the
        newest sample tables that fit in a tag value (`tables_tag`), unless that is `current`, its
        value now."""
        from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS

        value = tables_tag(self.sample_files)
        if value != current:
            self.set_tags({MLFLOW_LOGGED_ARTIFACTS: value})

    def published(self, step: int) -> bool:
        """Whether MLflow holds step `step`'s metrics and, for an iteration (step > 0), its sample table.
        False with tracking off: then only the store says what a step has done."""
        return self.enabled and step in self.logged_steps and (step == 0 or samples_file(step) in self.sample_files)

    def has_samples(self, step: int) -> bool:
        """Whether step `step`'s sample table is in MLflow (always, with tracking off)."""
        return not self.enabled or samples_file(step) in self.sample_files

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Step `step`'s sample table (prompt, response, reward, feedback, teacher context) as an MLflow
        table, `samples/iter-<step>.json`, which the UI's evaluation view can compare across runs.

        The file is what `mlflow.log_table` writes for a new table (a pandas frame as
        split-oriented JSON), and the run's `mlflow.loggedArtifacts` tag lists it, as `log_table`
        does. `log_table` itself is not used, for two reasons:
        - it appends its entry to that tag, whose value MLflow cuts at 8,000 characters, so the
          152nd table of a run leaves the tag as broken JSON and every later `log_table` on the run
          raises; here the tag lists the newest tables that fit (`tables_tag`);
        - it lists the run's artifacts and reads the run back on every call, so that it can append
          to a table of the same name: 26-39 ms of every iteration on a local store, more than the
          step's metrics. A step's table is written whole, once, and the tag is set with it.
        A step whose table is stored is skipped; a kill between the file and the tag is mended when
        the next tracker opens. `tests/unit/test_tracking.py` checks the file and the tag against
        `mlflow.log_table`'s.
        """
        import pandas as pd

        if not self.enabled or not rows or self.has_samples(step):
            return
        columns = {key: [row[key] for row in rows] for key in rows[0]}
        columns["iteration"] = [step] * len(rows)
        text = pd.DataFrame(columns).to_json(orient="split", index=False, date_format="iso")
        self.client.log_text(self.run_id, text, samples_file(step))
        self.sample_files.add(samples_file(step))
        self._list_tables(None)  # set: the new table is listed (unless ~147 newer ones are)

    def record_config_changes(self, changes: list[dict[str, Any]]) -> None:
        """Tag each accepted config change (`config_changes.jsonl` entries) once, with its diff:
        `sdpo.config_change.<i>` = "<time>: key: old -> new; ...", and log the params it added."""
        if not self.enabled:
            return
        recorded = int(self.client.get_run(self.run_id).data.tags.get(CHANGES_TAG, "0"))
        for i, change in enumerate(changes[recorded:], start=recorded + 1):
            diff = "; ".join(f"{d['key']}: {d['old']!r} -> {d['new']!r}" for d in change["diff"])
            self.set_tags({f"sdpo.config_change.{i}": f"{change['changed_at']}: {diff}"[:5000]})
            self.log_params({d["key"]: d["new"] for d in change["diff"]})
            self.set_tags({CHANGES_TAG: str(i)})

    def record_fork(self, fork: dict[str, Any]) -> None:
        """Tag a forked run with its parent and the iteration it started from, and name it for both
        and the settings it changed (`fork_run_name`), so its curves are told from its parent's in
        the UI's charts; when the parent's MLflow run is in the same experiment, link it by its id
        (`sdpo.parent_mlflow_run_id`) and in the run's description (a link that opens the UI's
        training view).

        A fork stays a top-level MLflow run, not one nested under its parent (`mlflow.parentRunId`):
        the UI's runs table collapses a parent's children, and its charts plot only the rows shown,
        so a nested fork's curves appeared only once the parent was expanded. A fork nested that way
        by an earlier version is lifted out here."""
        from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NOTE

        from storage.fork import describe_changes

        if not self.enabled:
            return
        tags = {PARENT_URL_TAG: fork["parent_run_url"], FORKED_AT_TAG: str(fork["iteration"])}
        parent = self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.`{RUN_URL_TAG}` = '{fork['parent_run_url']}'", max_results=1
        )
        run = self.client.get_run(self.run_id)
        have = run.data.tags
        if parent:
            info = parent[0].info
            tags[PARENT_RUN_TAG] = info.run_id
            link = f"#/experiments/{self.experiment_id}/runs/{info.run_id}?{TRAINING_VIEW}"
            note = (
                f"Forked from [{info.run_name}]({link}) at iteration {fork['iteration']}; changed: "
                f"{describe_changes(fork)}."
            )
            written = have.get(MLFLOW_RUN_NOTE)
            if written is None or written.startswith("Forked from ["):  # ours, not a description written in the UI
                tags[MLFLOW_RUN_NOTE] = note
            if have.get(MLFLOW_PARENT_RUN_ID) == info.run_id:
                self.client.delete_tag(self.run_id, MLFLOW_PARENT_RUN_ID)
        self.set_tags(tags)
        name = fork_run_name(self.name, fork)
        if run.info.run_name != name:
            self.client.update_run(self.run_id, name=name)

    def set_tags(self, tags: dict[str, str]) -> None:
        """Set the run's tags, once the scanner passes them (`storage.credentials.check_record`)."""
        if not self.enabled:
            return
        from mlflow.entities import RunTag

        check_record(tags, record=f"the MLflow tags of run {self.run_id}")
        items = [RunTag(key, value) for key, value in tags.items()]
        for i in range(0, len(items), 100):  # MLflow's limit on tags per batch
            self.client.log_batch(self.run_id, tags=items[i : i + 100])

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        """Log a file of the run's records (a JSON or text file is scanned first; a plot is not text)."""
        if not self.enabled:
            return
        if path.suffix in (".json", ".txt", ".md", ".yaml"):
            text = path.read_text()
            check_record(json.loads(text) if path.suffix == ".json" else text, record=f"MLflow artifact {path.name}")
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    @contextlib.contextmanager
    def system_metrics(self) -> Iterator[None]:
        """Sample the machine's CPU, memory, disk, network (and GPU, where there is one) into the run
        as `system/*` metrics while the block runs (every 10 s; MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL
        sets another period), continuing their steps on resume."""
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        if not (self.enabled and self.log_system_metrics):
            yield
            return
        monitor = SystemMetricsMonitor(self.run_id, resume_logging=True, tracking_uri=self.uri)
        monitor.start()
        try:
            yield
        finally:
            monitor.finish()

    def finish(self, status: str = "FINISHED") -> None:
        if not self.enabled:
            return
        self.client.set_terminated(self.run_id, status=status)


def fork_run_name(name: str, fork: dict[str, Any]) -> str:
    """The MLflow run name of fork `name`: its name, its parent and iteration, the settings it
    changed (cut to MLflow's limit on a run name), e.g. `demo-a1 (fork of demo at 4: loss.alpha 0.5 -> 1)`."""
    from storage.fork import describe_changes

    full = f"{name} (fork of {fork['parent']} at {fork['iteration']}: {describe_changes(fork)})"
    return full if len(full) <= _RUN_NAME_CHARS else full[: _RUN_NAME_CHARS - 2] + "…)"


def open_tracker(run: Any) -> Tracker:
    """The MLflow run of SDPO run `run` (created or resumed), with its accepted config changes and,
    for a fork, its parent tagged; the store checked against the digests it recorded
    (`tasks.tracking.anchor`), whose `tracker.anchor` records those of what the run commits next."""
    from storage.fork import read_fork
    from storage.layout import read_config_changes
    from tasks.tracking.anchor import RunAnchor
    from tasks.tracking.assets import log_datasets

    layout = run.layout
    local_root = Path(layout.store.path(layout.root_url)) if layout.store.backend == "file" else None
    tracker = Tracker(run.cfg, layout.run_url, local_root_dir=local_root)
    tracker.anchor = RunAnchor(tracker, layout)
    tracker.anchor.open()  # the store checked against the digests recorded when it was committed
    tracker.record_config_changes(read_config_changes(run.layout))
    log_datasets(tracker, run)
    fork = read_fork(layout)
    if fork is not None:
        tracker.record_fork(fork)
    return tracker
