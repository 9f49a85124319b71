"""A run started by `sdpo run` against a real `prefect server` and cancelled there, as an operator
cancels it (`prefect flow-run cancel`, the UI's Cancel).

While iteration 2's train stage runs as a process of its own (the subprocess launcher; held at its
`train.trained` point, its optimizer steps done and nothing saved): within seconds the stage process
is gone, the run lock is released and the flow run is Cancelled in Prefect (not Cancelling for
minutes); the CLI prints one line, what was cancelled, where the run stopped and the command that
resumes it, and exits with its own status (3). The command run again resumes the run, which ends
bit-identical to a run that was never cancelled.

With `pipeline.max_staleness: 1`, while the flow waits for iteration 3's rollout in the worker
process that runs it ahead of the training (held there): the cancel ends that process too.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.integration.prefect_server import Prefect, final_state, wait_for
from tests.integration.runs import TINY, differences, fingerprint, write_config

NAME = "cancelled"
BASE = {**TINY, "iterations": 3, "eval": {"enabled": False, "every": 0}}
LAUNCH = {"train": {"launcher": "subprocess"}}


def _sdpo_run(prefect: Prefect, config: Path, log: Path, **env: str) -> subprocess.Popen:
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "run", str(config)],
            cwd=config.parent,
            env=prefect.environment(OMP_NUM_THREADS="1", **env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    prefect.processes.append(process)
    return process


def _command_line(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:  # ended (or a zombie) since it was listed
        return ""


def _running(processes: list[psutil.Process], *, within_s: float = 10.0) -> list[str]:
    """Those of `processes` still running `within_s` seconds from now (none: at once)."""
    deadline = time.monotonic() + within_s
    while True:
        running = [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not running or time.monotonic() > deadline:
            return [_command_line(p) for p in running]
        time.sleep(0.2)


def _cancel(prefect: Prefect, run: subprocess.Popen, log: Path) -> None:
    """Cancel the run's flow run as an operator does; the command must end with status 3 soon after."""
    client = prefect.client()
    (flow_run,) = [r for r in client.read_flow_runs() if r.name == f"{NAME}/run-to-0003"]
    assert flow_run.state.is_running(), flow_run.state
    cancelled_at = time.monotonic()
    prefect.cli("flow-run", "cancel", str(flow_run.id))
    assert run.wait(timeout=60) == 3, log.read_text()[-4000:]
    assert time.monotonic() - cancelled_at < 30
    state = wait_for("the flow run to be Cancelled", lambda: final_state(client, flow_run.id), timeout=30, logs=[log])
    assert state.is_cancelled() and state.message.startswith("Cancelled in Prefect"), state


def test_a_cli_run_cancelled_in_prefect_stops_within_seconds_and_resumes_bit_identical(
    tmp_path: Path, prefect: Prefect
) -> None:
    from storage.layout import RunLayout
    from storage.lock import read_lock_holder
    from storage.manifest import read_latest

    config = write_config(tmp_path / "a", NAME, base=BASE, launch=LAUNCH)
    layout = RunLayout(str(tmp_path / "a" / "runs"), NAME)
    log = tmp_path / "run.log"
    run = _sdpo_run(prefect, config, log, SDPO_PAUSE_AT="train.trained@2")

    def training() -> list[psutil.Process]:
        assert run.poll() is None, log.read_text()[-4000:]
        below = psutil.Process(run.pid).children(recursive=True)
        return [p for p in below if "stage train" in _command_line(p) and "--iteration 2" in _command_line(p)]

    stages = wait_for("iteration 2's train stage", training, timeout=400, logs=[log], interval=0.5)
    time.sleep(3)  # well into the stage: held at its point, its steps done
    _cancel(prefect, run, log)
    assert _running(stages) == []
    assert read_lock_holder(layout) is None
    assert read_latest(layout) == 1

    output = log.read_text()
    assert "Traceback" not in output and " ERROR " not in output, output
    (line,) = [line for line in output.splitlines() if "cancelled in Prefect" in line]
    assert line == (
        f"run {NAME} was cancelled in Prefect: stopped in iteration 2 at its train stage (1 of 3 iterations "
        f"committed, the run lock released); resume it with: sdpo run {config}"
    ), line
    assert output.rstrip().endswith(line), output[-2000:]  # the command's last word

    # the command run again resumes; the run ends as one that was never cancelled
    again = _sdpo_run(prefect, config, tmp_path / "again.log")
    assert again.wait(timeout=600) == 0, (tmp_path / "again.log").read_text()[-4000:]
    reference = write_config(tmp_path / "b", NAME, base=BASE, launch=LAUNCH)
    whole = _sdpo_run(prefect, reference, tmp_path / "reference.log")
    assert whole.wait(timeout=600) == 0, (tmp_path / "reference.log").read_text()[-4000:]
    assert differences(fingerprint(layout), fingerprint(RunLayout(str(tmp_path / "b" / "runs"), NAME))) == []


def test_a_cancel_ends_the_stages_running_ahead_of_the_training(tmp_path: Path, prefect: Prefect) -> None:
    from storage.layout import RunLayout
    from storage.lock import read_lock_holder
    from storage.manifest import read_latest

    config = write_config(tmp_path, NAME, base={**BASE, "pipeline": {"max_staleness": 1}})
    layout = RunLayout(str(tmp_path / "runs"), NAME)
    log = tmp_path / "run.log"
    run = _sdpo_run(prefect, config, log, SDPO_PAUSE_AT="stage.start:rollout@3")

    def iteration_two_committed() -> bool:
        assert run.poll() is None, log.read_text()[-4000:]
        return read_latest(layout) == 2

    wait_for("iteration 2's commit", iteration_two_committed, timeout=400, logs=[log], interval=0.5)
    time.sleep(2)  # the flow waits for iteration 3's rollout, held at its start in the worker process
    below = psutil.Process(run.pid).children(recursive=True)
    _cancel(prefect, run, log)
    assert _running(below) == []
    assert read_lock_holder(layout) is None
    assert "stopped in iteration 3 at its rollout stage (2 of 3 iterations committed" in log.read_text()
