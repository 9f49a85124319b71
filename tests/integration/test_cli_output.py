"""What `sdpo run` prints, read as a user reads it: into a pipe, against a Prefect server.

One run of the CLI with stdout and stderr to pipes and PREFECT_API_URL set: its first line comes
at once, before Prefect and the libraries load; no progress-bar fragment reaches the pipe (no
carriage returns, no tqdm bars); no line is wrapped (the printed `mlflow ui ...` command is one
line) and it is followed by the address of the experiment's training view; the per-iteration
status lines are in the flow run's logs on the server. Then the same run under a changed config:
the old -> new differences on one screen, no traceback; and the same run again: it is finished, so
the command says so, prints the stored summary and publishes no second one.

What a run prints carries no library chatter: no MLflow system-metrics or model-card lines, no
ShardedTensor deprecation (a fork of the run loads its parent's training state), and a fork does not
print its parent's iterations as its own. `sdpo eval` prints its metrics alone, `sdpo gc` with
nothing to free names the settings to set, `--help` fits 80 columns, and each iteration leaves
Prefect link artifacts to its checkpoint and MLflow run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.runs import write_config

REPO = Path(__file__).resolve().parents[2]
NAME = "piped"


def run_cli(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Run `python -m flows.cli ARGS` with stdout and stderr to pipes; each line with the seconds
    after the start at which it arrived."""
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    streams: dict[str, list[tuple[float, bytes]]] = {"stdout": [], "stderr": []}

    def read(name: str, pipe: Any) -> None:
        for line in iter(pipe.readline, b""):
            streams[name].append((time.monotonic() - started, line))

    readers = [threading.Thread(target=read, args=(n, getattr(proc, n))) for n in streams]
    for reader in readers:
        reader.start()
    rc = proc.wait(timeout=600)
    for reader in readers:
        reader.join()
    raw = {n: b"".join(line for _, line in lines) for n, lines in streams.items()}
    return {"rc": rc, "lines": streams, "raw": raw, "text": {n: r.decode() for n, r in raw.items()}}


@pytest.fixture(scope="module")
def piped(tmp_path_factory, prefect_server) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("cli-output")
    config = write_config(tmp, NAME, tracking={"log_model": True, "system_metrics": True})
    env = {**os.environ, "PREFECT_API_URL": prefect_server, "PYTHONUNBUFFERED": "1", "COLUMNS": "80"}
    env.pop("FORCE_COLOR", None)
    done = run_cli(["run", str(config)], env)
    assert done["rc"] == 0, done["text"]["stdout"][-3000:] + done["text"]["stderr"][-3000:]
    return {**done, "config": config, "env": env, "tracking": f"sqlite:///{tmp / 'mlflow.db'}"}


def test_piped_output_has_no_progress_bars_and_no_wrapped_lines(piped):
    everything = piped["raw"]["stdout"] + piped["raw"]["stderr"]
    assert b"\r" not in everything and b"\x1b[" not in everything
    for fragment in ("█", "▏", "it/s", "batch/s", "step/s", "rollout:", "warm-up:", "%|"):
        assert fragment not in everything.decode(), fragment
    command = f"mlflow ui --backend-store-uri {piped['tracking']} --host 127.0.0.1 --port 5000"
    assert f"  {command}\n" in piped["text"]["stdout"]
    from mlflow.tracking import MlflowClient

    experiment = MlflowClient(piped["tracking"]).get_experiment_by_name("sdpo").experiment_id
    training_view = f"http://127.0.0.1:5000/#/experiments/{experiment}/runs?workflowType=machine_learning"
    assert f"  {command}\n  then open {training_view}\n" in piped["text"]["stdout"]
    status = [line for line in piped["text"]["stderr"].splitlines() if f"{NAME}: iteration " in line]
    assert len(status) == 2 and all(line.rstrip().endswith("s") for line in status), status
    assert all("eval greedy acc" in line for line in status)  # one line each, not cut at 80 columns


def test_the_first_line_comes_before_the_libraries_load(piped):
    (first_at, first), *_ = piped["lines"]["stderr"]
    assert first.decode().startswith(f"starting run {NAME} (config ")
    status_at = next(t for t, line in piped["lines"]["stderr"] if b"iteration 1/2 |" in line)
    # the run's first status line comes after Prefect, torch and the first iteration: many seconds
    assert first_at < status_at / 2, (first_at, status_at)


def test_a_cli_run_against_a_server_has_its_status_lines_in_the_flow_runs_logs(piped, prefect_server):
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, LogFilter, LogFilterFlowRunId

    client = SyncPrefectClient(prefect_server)
    (flow_run,) = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[f"{NAME}/run-to-0002"]))
    )
    logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run.id])))
    messages = [log.message for log in logs]
    for n in (1, 2):
        assert any(f"{NAME}: iteration {n}/2 | reward" in m for m in messages), messages


def test_a_changed_config_is_one_screen_without_a_traceback(piped):
    done = run_cli(["run", str(piped["config"]), "optimizer.lr=0.002"], piped["env"])
    assert done["rc"] != 0
    output = done["text"]["stdout"] + done["text"]["stderr"]
    assert "Traceback" not in output and "File " not in output, output
    assert len(output.splitlines()) < 25, output
    assert f"run '{NAME}' was created with another config" in output
    assert "optimizer.lr: 0.001 -> 0.002" in output and "--allow-config-change" in output


def test_a_finished_run_run_again_says_so_and_publishes_no_second_summary(piped, prefect_server):
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    done = run_cli(["run", str(piped["config"])], piped["env"])
    assert done["rc"] == 0, done["text"]["stdout"][-3000:] + done["text"]["stderr"][-3000:]
    output = done["text"]["stdout"]
    assert f"Skipped: run {NAME} is complete (2 iterations" in output, output
    assert "eval/greedy_accuracy" in output and "stages and evaluations" in output  # the stored summary
    assert "then open http://127.0.0.1:5000/#/experiments/" in output
    client = SyncPrefectClient(prefect_server)
    key = ArtifactFilter(key=ArtifactFilterKey(any_=[f"sdpo-{NAME}-summary"]))
    assert len(client.read_artifacts(artifact_filter=key)) == 1


CHATTER = (
    "system metrics",  # MLflow's monitor: "Started monitoring system metrics." and its stop lines
    "model card",  # MLflow's look-up of a hub card for a local policy
    "license information",
    "ShardedTensor",  # torch's FutureWarning when Megatron's checkpoint loads
    "FutureWarning",
    "temporary server",  # Prefect's ephemeral server
    "Still processing items",  # Prefect's queues at exit
)


def test_the_runs_output_carries_no_library_chatter(piped):
    output = piped["text"]["stdout"] + piped["text"]["stderr"]
    assert [c for c in CHATTER if c in output] == [], output


def test_each_iteration_links_its_checkpoint_and_mlflow_run_as_prefect_link_artifacts(piped, prefect_server):
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from storage.layout import RunLayout

    client = SyncPrefectClient(prefect_server)
    layout = RunLayout(str(piped["config"].parent / "runs"), NAME)
    found = {}
    for what in ("checkpoint", "mlflow-run"):
        key = ArtifactFilter(key=ArtifactFilterKey(any_=[f"sdpo-{NAME}-{what}"]))
        found[what] = client.read_artifacts(artifact_filter=key)
        assert len(found[what]) == 2, found[what]
    # a link artifact is Prefect's markdown of one link: `[text](address)`
    links = {what: [re.fullmatch(r"\[.+\]\((.+)\)", a.data) for a in found[what]] for what in found}
    assert all(links["checkpoint"]) and all(links["mlflow-run"]), found
    checkpoints = {m.group(1) for m in links["checkpoint"]}
    assert checkpoints == {layout.checkpoint_dir(n, "policy") for n in (1, 2)}, checkpoints
    assert all("workflowType=machine_learning" in m.group(1) for m in links["mlflow-run"])


def test_a_fork_prints_its_own_iterations_only(piped):
    """The fork's first iteration is its parent's: said once with what the fork changed, not
    printed as an iteration just run; its second trains from the parent's stored training state."""
    from typer.testing import CliRunner

    from flows.cli import app

    root = piped["config"].parent / "runs"
    fork_yaml = piped["config"].parent / "piped-fork.yaml"
    forked = CliRunner().invoke(
        app,
        ["fork", NAME, "--from-iteration", "1", "--name", "piped-fork", "--root", str(root)]
        + ["--config-out", str(fork_yaml), "optimizer.lr=0.002"],
    )
    assert forked.exit_code == 0, forked.output
    done = run_cli(["run", str(fork_yaml)], piped["env"])
    assert done["rc"] == 0, done["text"]["stdout"][-3000:] + done["text"]["stderr"][-3000:]
    err = done["text"]["stderr"]
    assert "a fork of piped: iterations 1-1 are its parent's (optimizer.lr 0.001 -> 0.002)" in err, err
    status = [line for line in err.splitlines() if "piped-fork: iteration " in line]
    assert len(status) == 1 and "iteration 2/2 |" in status[0], status
    output = done["text"]["stdout"] + err
    assert [c for c in CHATTER if c in output] == [], output


def test_eval_prints_its_metrics_alone(piped):
    env = {k: v for k, v in piped["env"].items() if k != "PREFECT_API_URL"}  # Prefect's ephemeral server
    env["PREFECT_HOME"] = str(piped["config"].parent / "prefect-home")
    done = run_cli(["eval", str(piped["config"]), "--iteration", "1"], env)
    assert done["rc"] == 0, done["text"]["stdout"][-3000:] + done["text"]["stderr"][-3000:]
    lines = done["text"]["stdout"].splitlines()
    assert lines and all(line.startswith("eval/") for line in lines), lines
    assert done["text"]["stderr"] == "", done["text"]["stderr"]


def test_gc_with_nothing_to_free_names_the_retention_settings(piped):
    from typer.testing import CliRunner

    from flows.cli import app

    done = CliRunner().invoke(app, ["gc", NAME, "--root", str(piped["config"].parent / "runs"), "--dry-run"])
    assert done.exit_code == 0, done.output
    text = " ".join(done.output.split())
    assert "would free 0.0 MiB" in text
    assert "nothing to free: storage.retention sets no rule" in text, text
    assert "storage.retention.resumable.last=N" in text and "storage.retention.weights.last=N" in text


@pytest.mark.parametrize("command", ["run", "advance", "test-time", "eval"])
def test_help_fits_80_columns_whole(command):
    env = {**os.environ, "COLUMNS": "80", "TERMINAL_WIDTH": "80"}
    done = run_cli([command, "--help"], env)
    text = done["text"]["stdout"]
    assert done["rc"] == 0 and "…" not in text, text
    if command != "eval":
        assert "--force-unlock " in text
    if command in ("run", "advance"):
        assert "--allow-config-change " in text
    if command == "eval":
        assert "-1 = the latest committed (LATEST)" in " ".join(text.replace("│", " ").split())
