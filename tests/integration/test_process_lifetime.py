"""A killed run leaves nothing running (tasks/lifetime.py): its stage processes, torchrun's ranks and
Prefect's ephemeral server end with it, however it was killed, and the run resumes.

Each run pauses its train stage (`SDPO_PAUSE_AT`, storage/faults.py), so a stage process left
behind would sleep until the end of the test rather than finish on its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.integration.runs import TINY, start_stage_worker, write_config

ONE = {**TINY, "iterations": 1, "eval": {"every": 0, "sampled_n": 2}}
PAUSED_TRAIN = {"SDPO_PAUSE_AT": "stage.start:train"}


def _command_line(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return ""


def _start(tmp_path: Path, launch: dict, *, api_url: str | None = None, **env: str) -> tuple[subprocess.Popen, Path]:
    """`sdpo run` of ONE in a session of its own, logging to a file: on the Prefect server at
    `api_url`, else on Prefect's ephemeral server."""
    config = write_config(tmp_path, "lifetime", base=ONE, launch=launch)
    environment = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    environment.update(PREFECT_HOME=str(tmp_path / "prefect-home"), OMP_NUM_THREADS="1", **env)
    if api_url is not None:
        environment["PREFECT_API_URL"] = api_url
    log = tmp_path / "run.log"
    with open(log, "a") as out:
        flow = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "run", str(config)],
            cwd=tmp_path,
            env=environment,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return flow, log


def _wait_for_stage(flow: subprocess.Popen, log: Path, *, processes: int = 1) -> list[psutil.Process]:
    """Every process below the run's once its train stage runs (with `processes` of its own)."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert flow.poll() is None, log.read_text()[-4000:]
        below = psutil.Process(flow.pid).children(recursive=True)
        stage = [p for p in below if "stage train" in _command_line(p)]
        if len(stage) >= processes:
            time.sleep(2)  # well into the stage's start-up
            return psutil.Process(flow.pid).children(recursive=True)
        time.sleep(0.2)
    raise AssertionError(f"the train stage did not start:\n{log.read_text()[-4000:]}")


def _left_running(processes: list[psutil.Process], *, within_s: float) -> list[str]:
    deadline = time.monotonic() + within_s
    while True:
        running = [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not running or time.monotonic() > deadline:
            return [f"{p.pid} {_command_line(p)[:160]}" for p in running]
        time.sleep(0.2)


def _kinds(processes: list[psutil.Process]) -> set[str]:
    found = set()
    for p in processes:
        line = _command_line(p)
        for kind, marker in (("server", "uvicorn"), ("guard", "tasks.lifetime"), ("stage", "stage train")):
            if marker in line:
                found.add(kind)
    return found


def _stage_runs(deployment: str) -> list:
    """The flow runs of this test's train stage on `deployment` (other tests' runs are named alike)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId, FlowRunFilter, FlowRunFilterName

    named = FlowRunFilter(name=FlowRunFilterName(any_=["lifetime/iter-0001/train"]))
    with get_client(sync_client=True) as client:
        ours = DeploymentFilter(id=DeploymentFilterId(any_=[client.read_deployment_by_name(deployment).id]))
        return client.read_flow_runs(flow_run_filter=named, deployment_filter=ours)


def _wait_for_stage_run(deployment: str, flow: subprocess.Popen, log: Path) -> None:
    """Until the train stage's flow run runs on the worker, and 3 s more (well into its start-up)."""
    deadline = time.monotonic() + 300
    while not any(r.state is not None and r.state.is_running() for r in _stage_runs(deployment)):
        assert flow.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.5)
    time.sleep(3)


def test_a_run_killed_with_sigkill_takes_its_stage_process_and_prefect_server_with_it(tmp_path):
    flow, log = _start(tmp_path, {"train": {"launcher": "subprocess"}}, **PAUSED_TRAIN)
    below = _wait_for_stage(flow, log)
    assert _kinds(below) >= {"server", "guard", "stage"}, [_command_line(p) for p in below]
    flow.kill()  # as the OOM killer would: no handler, no atexit
    flow.wait()
    assert _left_running(below, within_s=20) == []


def test_a_run_ended_with_sigterm_cleans_up_and_resumes(tmp_path):
    from storage.layout import RunLayout
    from storage.manifest import read_latest

    flow, log = _start(tmp_path, {"train": {"launcher": "subprocess"}}, **PAUSED_TRAIN)
    below = _wait_for_stage(flow, log)
    flow.send_signal(signal.SIGTERM)  # what `kill`, a scheduler or a Prefect worker's cancellation sends
    assert flow.wait(timeout=60) == 128 + signal.SIGTERM, log.read_text()[-4000:]
    assert _left_running(below, within_s=20) == []
    assert "SIGTERM received" in log.read_text()
    again, log = _start(tmp_path, {"train": {"launcher": "subprocess"}})
    assert again.wait(timeout=600) == 0, log.read_text()[-4000:]
    assert read_latest(RunLayout(str(tmp_path / "runs"), "lifetime")) == 1


def test_the_ranks_of_a_torchrun_stage_end_when_torchrun_is_killed(tmp_path):
    """A stage past its timeout has torchrun's process group killed (`tasks.launch`); each rank
    leads a group of its own, and ends on seeing torchrun gone."""
    launch = {"train": {"launcher": "torchrun", "nproc_per_node": 2}}
    flow, log = _start(tmp_path, launch, **PAUSED_TRAIN)
    below = _wait_for_stage(flow, log, processes=3)  # torchrun and its two ranks
    ranks = [p for p in below if "stage train" in _command_line(p) and "torch.distributed.run" not in _command_line(p)]
    assert len(ranks) == 2, [_command_line(p) for p in below]
    torchrun = next(p for p in below if "torch.distributed.run" in _command_line(p))
    os.killpg(torchrun.pid, signal.SIGKILL)  # what the timeout does
    assert _left_running(ranks, within_s=20) == []
    assert flow.wait(timeout=120) != 0  # the stage failed
    assert "exited with -9" in log.read_text(), log.read_text()[-4000:]
    assert _left_running(below, within_s=20) == []


_RANK = (
    "import sys, time; from tasks.lifetime import watch_starter; "
    "assert watch_starter(poll_s=0.2); print('watching', flush=True); time.sleep(30)"
)


def _rank_under(agent_argv: list[str]) -> subprocess.Popen:
    """A stand-in rank (watch_starter, then sleep) as the child of a parent started with `agent_argv`
    + a script that starts the rank and waits for it; the parent's stdout is the rank's."""
    from tasks.lifetime import child_environment

    env = {**os.environ, **child_environment(), "TORCHELASTIC_RUN_ID": "lifetime-test"}
    # the parent exits with the signal that ended the rank (9 for SIGKILL), or 100 + its exit status
    spawn = f"import subprocess, sys; rc = subprocess.call([sys.executable, '-c', {_RANK!r}]); sys.exit(-rc if rc < 0 else 100 + rc)"
    return subprocess.Popen(
        [sys.executable, "-c", spawn, *agent_argv], env=env, cwd=Path(__file__).parents[2], stdout=subprocess.PIPE
    )


def test_a_rank_whose_torchrun_agent_ended_before_it_watched_ends_at_once():
    """A rank re-parented before its watch began (its agent killed while it imported) has a parent
    that is not torchrun's: it ends at once, rather than watch its new parent and never end."""
    not_an_agent = _rank_under([])  # the rank's parent is a plain python process
    assert not_an_agent.wait(timeout=60) == signal.SIGKILL
    assert b"watching" not in not_an_agent.stdout.read()
    # the control: under a parent that is torchrun's agent, the rank watches and sleeps on
    agent = _rank_under(["torch.distributed.run"])
    assert agent.stdout.readline() == b"watching\n"
    time.sleep(1.0)
    assert agent.poll() is None
    agent.kill()  # its agent gone: the rank sees it within a poll and ends
    agent.wait()


@pytest.fixture(autouse=True)
def _nothing_left(tmp_path):
    """Whatever a failing test leaves is killed, so it does not outlive the test session."""
    yield
    for p in psutil.process_iter():
        try:
            mine = str(tmp_path) in _command_line(p) or str(tmp_path) in p.environ().get("PREFECT_HOME", "")
        except psutil.Error:
            continue
        if mine:
            p.kill()


def test_an_identity_outlives_neither_its_process_nor_a_reuse_of_its_pid():
    from tasks.lifetime import alive, identity

    child = subprocess.Popen(["sleep", "30"])
    ident = identity(child.pid)
    boot, pid, start = ident.split(":")
    assert alive(ident)
    assert not alive(f"{boot}:{pid}:{int(start) + 1}")  # another process given the same pid later
    assert alive(f"another-boot:{pid}:{start}")  # a process of another machine is not judged from here
    child.kill()
    time.sleep(0.5)
    assert not alive(ident)  # ended, not yet reaped (a zombie)
    child.wait()
    assert not alive(ident)
    with pytest.raises(ProcessLookupError):
        identity(child.pid)


def test_stop_escalates_to_sigkill_for_a_process_that_ignores_sigterm():
    from tasks.lifetime import alive, identity, stop

    stubborn = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    stubborn.stdout.readline()  # its handler is in place
    ident = identity(stubborn.pid)
    started = time.monotonic()
    stop(ident, grace_s=1.0)
    assert stubborn.wait(timeout=10) == -signal.SIGKILL
    assert 1.0 <= time.monotonic() - started < 10
    assert not alive(ident)


_TERMINATED = """
import sys, time
from tasks.lifetime import end_on_termination
end_on_termination()
try:
    print("ready", flush=True)
    time.sleep(60)
finally:
    print("cleaned up", flush=True)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_end_a_command_through_its_cleanup(signum):
    command = subprocess.Popen([sys.executable, "-c", _TERMINATED], stdout=subprocess.PIPE, text=True)
    assert command.stdout.readline() == "ready\n"
    command.send_signal(signum)
    assert command.wait(timeout=30) == 128 + signum
    assert command.stdout.read() == "cleaned up\n"


def test_a_stage_on_a_work_pool_is_cancelled_when_its_run_is_killed(tmp_path, prefect_server):
    """The train stage runs as a flow run on a real process worker and pauses there; the run's
    process is killed with SIGKILL; its guard sets the flow run to Cancelling and the worker ends it."""
    deployment, worker = start_stage_worker(tmp_path, prefect_server, **PAUSED_TRAIN)  # the stage pauses there
    try:
        flow, log = _start(
            tmp_path, {"train": {"launcher": "work-pool", "deployment": deployment}}, api_url=prefect_server
        )
        _wait_for_stage_run(deployment, flow, log)
        below = psutil.Process(worker.pid).children(recursive=True)  # the flow run's process
        assert below, (tmp_path / "worker.log").read_text()[-3000:]
        flow.kill()
        flow.wait()
        stage_run = lambda: _stage_runs(deployment)[0]  # noqa: E731
        deadline = time.monotonic() + 60
        while stage_run().state.type.value not in ("CANCELLED", "CANCELLING") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert stage_run().state.type.value in ("CANCELLED", "CANCELLING"), stage_run().state
        assert _left_running(below, within_s=30) == [], (tmp_path / "worker.log").read_text()[-3000:]
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=30)


def test_a_resumed_run_waits_for_the_stage_flow_run_its_lost_process_left(tmp_path, prefect_server):
    """The run's process and its guard die together (the machine that ran them is lost) while the
    train stage runs on a work pool; the same command, run again, waits for that flow run instead of
    starting a second one, and finishes once the stage does."""
    from storage.layout import RunLayout
    from storage.manifest import read_latest

    go = tmp_path / "go"  # the paused stage goes on once this file exists
    deployment, worker = start_stage_worker(tmp_path, prefect_server, **PAUSED_TRAIN, SDPO_PAUSE_UNTIL=str(go))
    launch = {"train": {"launcher": "work-pool", "deployment": deployment}}
    try:
        flow, log = _start(tmp_path, launch, api_url=prefect_server)
        _wait_for_stage_run(deployment, flow, log)
        guards = [p for p in psutil.Process(flow.pid).children(recursive=True) if "tasks.lifetime" in _command_line(p)]
        assert guards, log.read_text()[-3000:]
        for guard in guards:
            guard.kill()
        flow.kill()
        flow.wait()
        (left,) = _stage_runs(deployment)
        assert left.state.is_running(), left.state

        again, log = _start(tmp_path, launch, api_url=prefect_server)
        deadline = time.monotonic() + 240
        while f"flow run lifetime/iter-0001/train ({left.id}): attaching to it" not in " ".join(
            log.read_text().split()
        ):
            assert again.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        go.touch()
        assert again.wait(timeout=300) == 0, log.read_text()[-4000:]
        (done,) = _stage_runs(deployment)  # no second flow run of the stage
        assert done.id == left.id and done.state.is_completed(), done.state
        assert read_latest(RunLayout(str(tmp_path / "runs"), "lifetime")) == 1
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=30)
