"""`sdpo mlflow-ui`: the MLflow UI on the runs of a root, opened on their training view; and the
commands `sdpo run` prints to get there.

MLflow's UI (3.17) opens a page in the view last chosen at the top of its sidebar, "GenAI" in a new
browser (its choice lives in the browser's localStorage; mlflow/mlflow#24498), even for an
experiment of training runs: an address opens the training view only when it says so
(`tasks.tracking.experiment.TRAINING_VIEW`). Every link printed here carries it, on the port the UI
is started on.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import typer

from flows.cli.app import app, fail

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 5000


def ui_address(ui_url: str | None) -> tuple[str, int]:
    """(host, port) of the MLflow UI `tracking.ui_url` names; MLflow's own defaults without one."""
    if ui_url is None:
        return DEFAULT_HOST, DEFAULT_PORT
    parts = urlsplit(ui_url)
    return parts.hostname or DEFAULT_HOST, parts.port or DEFAULT_PORT


def ui_commands(cfg: Any, experiment_id: str | None) -> list[str]:
    """What opens the MLflow UI on a run, at the host and port of its `tracking.ui_url`: the command
    that starts the UI on the run's store (none for a tracking server, which serves its own), then
    the address of the experiment's training runs (with tracking on)."""
    from flows.artifacts import mlflow_experiment_link

    host, port = ui_address(cfg.tracking.ui_url)
    lines = []
    if cfg.tracking.uri is None:  # the store beside the run root
        at = "" if host == DEFAULT_HOST else f" --host {host}"
        lines.append(f"sdpo mlflow-ui --root {cfg.storage.root} --port {port}{at}")
    elif not cfg.tracking.uri.startswith(("http://", "https://")):
        lines.append(f"mlflow ui --backend-store-uri {cfg.tracking.uri} --host {host} --port {port}")
    if experiment_id is not None:
        lines.append(f"then open {mlflow_experiment_link(f'http://{host}:{port}', experiment_id)}")
    return lines


@app.command("mlflow-ui")
def mlflow_ui(
    root: Annotated[str, typer.Option(help="run root (path or URL) whose MLflow store to open")] = "runs",
    port: Annotated[int, typer.Option(help="port of the MLflow UI")] = DEFAULT_PORT,
    host: Annotated[str, typer.Option(help="interface to bind; the default serves this machine only")] = DEFAULT_HOST,
) -> None:
    """Start the MLflow UI on the store of a run root (`<root>/mlflow.db`; `.sdpo/mlflow.db` for an
    object-store root) and print the address of each experiment's training runs on this port. A
    store moved or copied with its runs folder first has its artifact locations rewritten to where it
    is now, and says so. Runs `mlflow ui` in this process until Ctrl-C."""
    from mlflow.tracking import MlflowClient

    from flows.artifacts import mlflow_experiment_link
    from storage.urls import protocol
    from tasks.tracking.experiment import EXPERIMENT_KIND_TAG, TRAINING_KIND
    from tasks.tracking.relocate import relocate_store

    base = Path(root.removeprefix("file://")) if protocol(root) == "file" else Path(".sdpo")
    db = (base / "mlflow.db").resolve()
    if not db.is_file():
        fail(
            f"no MLflow store at {db}: the runs under --root {root} log to it when tracking.uri is unset; "
            "for another tracking.uri, `mlflow ui --backend-store-uri URI`"
        )
    moved = relocate_store(db)
    if moved is not None:
        typer.echo(moved.describe())
    store = f"sqlite:///{db}"
    for experiment in MlflowClient(store).search_experiments():
        if experiment.tags.get(EXPERIMENT_KIND_TAG) == TRAINING_KIND:
            link = mlflow_experiment_link(f"http://{host}:{port}", experiment.experiment_id)
            typer.echo(f"experiment {experiment.name}: {link}")
    typer.echo(f"MLflow UI on {store} (Ctrl-C stops it)")
    sys.stdout.flush()  # what was printed, before this process becomes the UI's
    command = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", store, "--host", host, "--port", str(port)]
    os.execv(sys.executable, command)
