"""The real sglang-router (`python -m sglang_router.launch_router`) in front of SGLang-API servers.

`start_router` launches it as a child process on a free 127.0.0.1 port with the flags
`infra/sglang/launch.sh` uses, and returns once the router answers `/health` and its `/workers`
lists every worker as healthy (the router answers `/health` before it has registered any).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

__all__ = ["RunningRouter", "router_command", "start_router"]


def router_command(worker_urls: list[str], *, host: str, port: int, policy: str = "round_robin") -> list[str]:
    """The router's command line (as `infra/sglang/launch.sh` builds it)."""
    return [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        *worker_urls,
        "--host",
        host,
        "--port",
        str(port),
        "--policy",
        policy,
        "--log-level",
        "warn",
    ]


@dataclass
class RunningRouter:
    """A router child process; `stop()` terminates it."""

    url: str
    process: subprocess.Popen
    log_path: Path

    def workers(self) -> list[dict]:
        return httpx.get(f"{self.url}/workers", timeout=5).json()["workers"]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> RunningRouter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_router(
    worker_urls: list[str], *, policy: str = "round_robin", timeout_s: float = 30.0, wait_for_workers: bool = True
) -> RunningRouter:
    """Start the router for `worker_urls`; returns when it routes to all of them (or, without
    `wait_for_workers`, as soon as it answers /health)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log_path = Path(tempfile.mkdtemp(prefix="sglang-router-")) / "router.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            router_command(worker_urls, host="127.0.0.1", port=port, policy=policy),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    router = RunningRouter(url=f"http://127.0.0.1:{port}", process=process, log_path=log_path)
    deadline = time.monotonic() + timeout_s
    state = "no answer yet"
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the router exited with {process.returncode}:\n{router.log()[-3000:]}")
        try:
            if httpx.get(f"{router.url}/health", timeout=2).status_code == 200:
                if not wait_for_workers:
                    return router
                healthy = {w["url"] for w in router.workers() if w["is_healthy"]}
                if healthy >= set(worker_urls):
                    return router
                state = f"healthy workers {sorted(healthy)}"
        except httpx.TransportError as exc:
            state = f"{type(exc).__name__}: {exc}"
        time.sleep(0.2)
    router.stop()
    raise RuntimeError(
        f"the router did not route to {worker_urls} within {timeout_s:g}s ({state}):\n{router.log()[-3000:]}"
    )
