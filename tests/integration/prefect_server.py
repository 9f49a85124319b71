"""A real `prefect server` for the deployment tests, the commands run against it, and waiting on it.

`Prefect` holds the server's URL and the environment every command gets (its own PREFECT_HOME, a
5 s scheduler loop, workers polling every 2 s, SDPO_REPO_DIR = this checkout); the `prefect`
fixture of conftest.py starts one per test and kills every process started through it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PREFECT = [sys.executable, "-m", "prefect"]


class Prefect:
    """A `prefect server` on 127.0.0.1 with its own PREFECT_HOME, and the commands run against it."""

    def __init__(self, home: Path, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/api"
        self.port = port
        self.env = {
            **os.environ,
            "PREFECT_HOME": str(home),
            "PREFECT_API_URL": self.url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_CLI_PROMPT": "false",
            "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5",
            "PREFECT_WORKER_QUERY_SECONDS": "2",
            "PREFECT_WORKER_PREFETCH_SECONDS": "2",
            "SDPO_REPO_DIR": str(REPO),
            "PYTHONUNBUFFERED": "1",
        }
        self.processes: list[subprocess.Popen] = []

    def environment(self, unset: Iterable[str] = (), **env: str) -> dict[str, str]:
        """The commands' environment with `env` set and the variables `unset` left out."""
        return {k: v for k, v in {**self.env, **env}.items() if k not in set(unset)}

    def start(
        self, args: list[str], log: Path, *, cwd: Path = REPO, unset: Iterable[str] = (), **env: str
    ) -> subprocess.Popen:
        """`prefect ARGS` in the background, in a process group of its own, its output to `log`."""
        out = log.open("ab")
        proc = subprocess.Popen(
            [*PREFECT, *args],
            cwd=cwd,
            env=self.environment(unset, **env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.processes.append(proc)
        return proc

    def cli(self, *args: str, unset: Iterable[str] = (), **env: str) -> str:
        """`prefect ARGS`, which must succeed; its stdout."""
        done = subprocess.run(
            [*PREFECT, *args], cwd=REPO, env=self.environment(unset, **env), capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout

    def client(self) -> Any:
        from prefect.client.orchestration import SyncPrefectClient

        return SyncPrefectClient(self.url)


def kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def flow_runs(client: Any, deployment_id: Any) -> list[Any]:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    return client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))


def wait_for(
    what: str, predicate: Callable[[], Any], *, timeout: float, logs: list[Path], interval: float = 2.0
) -> Any:
    """The first truthy value of `predicate()`, polled every `interval` s; fails after `timeout` s
    with the tails of `logs`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(interval)
    tails = "\n".join(f"--- {p.name}:\n{p.read_text()[-4000:]}" for p in logs if p.exists())
    raise AssertionError(f"timed out waiting for {what}\n{tails}")


def run_id_of(output: str) -> str:
    """The flow run id `prefect deployment run` printed."""
    match = re.search(r"UUID: ([0-9a-f-]{36})", output)
    assert match, output
    return match.group(1)


def final_state(client: Any, flow_run_id: Any) -> Any:
    """The flow run's state once final, else None."""
    state = client.read_flow_run(flow_run_id).state
    return state if state is not None and state.is_final() else None
