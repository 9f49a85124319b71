"""Processes that do not outlive the process that started them.

An `sdpo run` starts other processes: Prefect's ephemeral server, and with the subprocess and
torchrun launchers one process per stage (under torchrun, one more per rank). When the run's process
is killed, none of them goes with it by itself. SIGKILL (the kernel's OOM killer, `kill -9`) runs no
handler and no `atexit`; a stage process lives in a session of its own (`tasks.launch`), so a signal
to the run's process group misses it; and torchrun starts each rank in a session of its own, so
killing torchrun leaves its ranks. Left behind, a stage keeps its GPUs and goes on writing outputs
that the resumed run writes too, and the server keeps its memory and its database open.

- `end_on_termination`: in an `sdpo` command, SIGTERM and SIGHUP end the command as Ctrl-C does:
  through its `finally` blocks and `atexit` handlers (stage processes killed, the server stopped,
  the run lock released), with exit status 128 + the signal's number. A second one ends it at once.
- `child_environment` / `watch_starter`: a stage process gets the identity of the process that
  launched it (`SDPO_STARTED_BY`). It checks once a second that this process, and its own parent
  (torchrun's agent, for a rank), still run. When one is gone, it kills its process group. A rank
  whose parent is no longer torchrun's agent when it starts watching (the agent ended first, and the
  rank was re-parented) ends at once.
- `guard`: for a process that runs no code of ours (Prefect's server), a guard process
  (`python -m tasks.lifetime process TARGET`) waits for the process that started it to end, then
  stops TARGET: SIGTERM, then SIGKILL after `GRACE_S`.
- `guard_flow_run`: for a stage on a Prefect work pool, a guard (`python -m tasks.lifetime
  flow-run ID`) that sets the stage's flow run to Cancelling once the process that waits for it has
  ended; the pool's worker then ends the flow run's process.

A process's identity is its machine's boot id, its pid and its start time (Linux's /proc), so a pid
the system reuses for another process is not taken for it, and a starter on another machine (a
torchrun node of a multi-node stage) is not watched from this one.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

STARTED_BY_ENV = "SDPO_STARTED_BY"
TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"  # set by torchrun's agent in each rank's environment
POLL_S = 1.0
GRACE_S = 5.0
_PROC = Path("/proc")


def _boot_id() -> str:
    """This machine's boot id ('' where there is no /proc)."""
    path = _PROC / "sys/kernel/random/boot_id"
    return path.read_text().strip() if path.exists() else ""


def _state_and_start(pid: int) -> tuple[str, str] | None:
    """(state letter, start time in clock ticks after boot) of a process, None when there is none.
    Without /proc: ('', '') for any pid the system knows."""
    if not _PROC.is_dir():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass  # it exists, run by someone else
        return "", ""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces and ')'
    return fields[0], fields[19]  # fields 3 (state) and 22 (starttime) of proc(5)


def identity(pid: int | None = None) -> str:
    """`boot:pid:start` of process `pid` (this process by default); raises if there is none."""
    pid = os.getpid() if pid is None else pid
    found = _state_and_start(pid)
    if found is None:
        raise ProcessLookupError(f"no process {pid}")
    return f"{_boot_id()}:{pid}:{found[1]}"


def alive(ident: str) -> bool:
    """Whether the process of `identity()` `ident` still runs. A zombie (ended, not yet reaped) does
    not; a process of another machine counts as running, since this one cannot see it."""
    boot, pid, start = ident.split(":")
    if boot != _boot_id():
        return True
    found = _state_and_start(int(pid))
    return found is not None and found[0] != "Z" and found[1] == start


def end_on_termination() -> None:
    """SIGTERM and SIGHUP raise SystemExit(128 + signal) in the main thread, once; a second such
    signal ends the process at once (the default action). Call from the main thread."""

    def end(signum: int, frame: Any) -> None:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        logger.warning("%s received: ending (a second one ends the process at once)", signal.Signals(signum).name)
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, end)


def child_environment() -> dict[str, str]:
    """What to add to a launched process's environment so that it watches this process."""
    return {STARTED_BY_ENV: identity()}


def watch_starter(*, poll_s: float = POLL_S) -> bool:
    """In a process launched with `child_environment()`: a daemon thread kills this process's group
    (this process alone if it leads none) once its starter or its parent has ended. Returns whether
    it watches (False without SDPO_STARTED_BY: a process a scheduler started is the scheduler's)."""
    starter = os.environ.get(STARTED_BY_ENV)
    if not starter:
        return False
    if TORCHRUN_ENV in os.environ and not _is_torchrun(os.getppid()):
        # a rank whose agent ended before this check was re-parented (to init or a subreaper): the
        # parent it has now is not the one to watch, and the one it had is gone
        logger.error("torchrun's agent ended before this rank began to watch it: ending this process and its group")
        _end_own_group()
    watched = {"the process that launched this stage": starter, "this process's parent": identity(os.getppid())}

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            for who, ident in watched.items():
                if not alive(ident):
                    try:  # the log's reader may have been that process: a broken pipe must not stop the end
                        logger.error("%s (%s) has ended: ending this process and its group", who, ident)
                    finally:
                        _end_own_group()

    threading.Thread(target=watch, name="sdpo-watch-starter", daemon=True).start()
    return True


def _is_torchrun(pid: int) -> bool:
    """Whether process `pid` is torchrun's agent (`python -m torch.distributed.run` or the `torchrun`
    script); True where there is no /proc to tell."""
    if not _PROC.is_dir():
        return True
    try:
        argv = (_PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError):
        return False
    return b"torch.distributed.run" in argv or any(Path(a.decode(errors="replace")).name == "torchrun" for a in argv)


def _end_own_group() -> None:
    if os.getpgid(0) == os.getpid():  # a session or group leader: what it started goes too
        os.killpg(0, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def guard(pid: int) -> subprocess.Popen[bytes]:
    """Start a guard process that stops process `pid` once this process has ended."""
    return _start_guard("process", identity(pid))


def guard_flow_run(flow_run_id: Any) -> subprocess.Popen[bytes]:
    """Start a guard that cancels Prefect flow run `flow_run_id` once this process has ended; the
    caller kills it (SIGKILL: it ignores the others) once the flow run needs no guarding."""
    return _start_guard("flow-run", str(flow_run_id))


def cancel_flow_run(flow_run_id: Any) -> None:
    """Set a Prefect flow run that has not ended to Cancelling (its worker then ends its process)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run_id).state
        if state is None or not state.is_final():
            client.set_flow_run_state(
                flow_run_id, Cancelling(message="the run that waited for it has ended"), force=True
            )


def _start_guard(kind: str, target: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tasks.lifetime", kind, target],
        env={**os.environ, **child_environment()},
        # nothing of this process's: a reader of its output pipes gets their end when this process ends
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # signals to this process's group (Ctrl-C) are not for it
    )


def stop(ident: str, *, grace_s: float = GRACE_S) -> None:
    """SIGTERM the process `ident`, SIGKILL it if it still runs `grace_s` later; nothing if it has ended."""
    if not alive(ident):
        return
    pid = int(ident.split(":")[1])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive(ident) and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive(ident):
        os.kill(pid, signal.SIGKILL)


def _guard_main(kind: str, target: str) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # it ends when its starter has; then it has one thing to do
    starter = os.environ[STARTED_BY_ENV]
    while alive(starter):
        time.sleep(POLL_S)
    if kind == "process":
        stop(target)
    elif kind == "flow-run":
        cancel_flow_run(target)
    else:
        raise ValueError(f"unknown guard kind {kind!r}: process or flow-run")


if __name__ == "__main__":
    _guard_main(sys.argv[1], sys.argv[2])
