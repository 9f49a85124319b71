"""Sandboxed execution of model-written programs against a test suite (the code verifier's runner).

One call of `run_program` starts one sandbox (tasks/sandbox/harness.py): a judge process that
holds the report pipe, and a zygote, forked before the judge reads the tests, which forks a fresh
call process for each test (each call, for assert tests): the only processes executing the
program, none of which sees what an earlier one did. The judge reports each test's raw output over
the pipe; the parent enforces the per-test and total wall-clock limits by watching that pipe, and
kills the whole process group on overrun. Expected outputs never enter the sandbox:
`sdpo_core.verifiers.code.judge` compares them in the parent; assert-style tests run in the judge,
in a namespace that takes only the suite's entry points from the program, calling them through
proxies that return plain values.

Isolation levels (`SandboxLimits.isolation`):
- "namespace" (Linux, root, `unshare` present): new network, mount, pid, ipc and uts namespaces.
  The program sees a minimal root: read-only /usr and interpreter prefix, /dev/null, /dev/zero,
  /dev/urandom and a size-limited tmpfs as working and home directory; the repository, /home,
  /tmp, /work and /etc do not exist there, and of /root only the interpreter's prefix, if it
  lives there. It runs as a random unprivileged uid with
  no_new_privs, so it can signal nothing outside, RLIMIT_NPROC bounds its processes and when the
  sandbox's init process dies the kernel kills every process left in the pid namespace.
  The network namespace has only a loopback that is down: every connect fails.
- "process" (opt-in by name, with a warning): a plain child process with no_new_privs, the same
  rlimits, a scrubbed environment and a fresh temporary working directory; as root the zygote
  drops to a random unprivileged uid. File, network, process and signal restrictions then rest on
  that uid and on the Python-level guard (an audit hook, installed in each call process, that
  admits only the native modules of tasks/sandbox/extensions.py), which a crafted bytecode exploit
  of the interpreter could bypass.
- "auto": "namespace"; where it is unavailable the run is refused (name "process" to accept the
  weaker level).
Memory: one limit for the whole sandbox (tasks/sandbox/memory.py).
The Python-level guard (`python_guard`) also runs on top of namespace isolation unless turned off.
docs/tasks.md states the guarantees of each level.

How a sandbox starts (its isolation level, command, environment and rlimits) is
tasks/sandbox/isolation.py; starting it, watching its pipe and killing it are one sequence here,
whose security argument reads top to bottom; the harness, zygote and call processes, guard, codec
and memory limit are modules of their own.
"""

from __future__ import annotations

import json
import logging
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from sdpo_core.records import Verdict
from sdpo_core.verifiers import code as code_verifier
from sdpo_core.verifiers.code import EXEC_STATUSES, Execution, TestRunner, TestSuite
from tasks.sandbox.isolation import (
    MIB,
    WORKDIR_IN_ROOT,
    SandboxLimits,
    SandboxUnavailable,
    isolation_level,
    job_bytes,
    namespace_command,
    namespace_isolation_available,
    process_command,
    rlimits,
    scrubbed_env,
)
from tasks.sandbox.memory import memory_cgroup

__all__ = [
    "SandboxLimits",
    "SandboxUnavailable",
    "namespace_isolation_available",
    "run_program",
    "runner",
    "verify_code",
]

logger = logging.getLogger(__name__)

DEFAULT_LIMITS = SandboxLimits()

# the harness and the modules it imports, as (file here, name inside the sandbox)
_UID_RANGE = (200_000, 260_000)  # unprivileged uids no account uses; a random one per run
_STARTUP_GRACE_S = 5.0  # interpreter start before the first test; counts against total_s only


class _Reader:
    """Splits the result pipe into JSON messages in linear time; a line over `max_bytes` or anything
    unreadable becomes {"event": "corrupt"} (an oversized one {"event": "oversized"})."""

    def __init__(self, fd: int, *, max_bytes: int) -> None:
        self.fd, self.max_bytes, self.eof = fd, max_bytes, False
        self.buffer, self.scanned = bytearray(), 0

    def read(self, timeout: float) -> list[dict]:
        ready, _, _ = select.select([self.fd], [], [], max(timeout, 0.0))
        if not ready:
            return []
        chunk = os.read(self.fd, 1 << 20)
        if not chunk:
            self.eof = True
        self.buffer += chunk
        messages = []
        while (end := self.buffer.find(b"\n", self.scanned)) >= 0:
            line = bytes(self.buffer[:end])
            del self.buffer[: end + 1]
            self.scanned = 0
            if line.strip():
                messages.append(self._parse(line))
        self.scanned = len(self.buffer)
        if self.scanned > self.max_bytes:
            self.eof = True
            messages.append({"event": "oversized"})
        return messages

    @staticmethod
    def _parse(line: bytes) -> dict:
        try:
            message = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return {"event": "corrupt"}
        return message if isinstance(message, dict) else {"event": "corrupt"}


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the sandbox's process group, then reap the leader.

    Only while the leader is unreaped: its pid then still names the group, so the signal cannot
    reach an unrelated group that reused the number.
    """
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the group is already empty
    proc.wait()


def _exit_description(returncode: int | None) -> str:
    if returncode is None:
        return "the program stopped reporting"
    if returncode < 0:
        return f"the program crashed (killed by {signal.Signals(-returncode).name})"
    if returncode > 128 and returncode - 128 in signal.valid_signals():
        return f"the program crashed (killed by {signal.Signals(returncode - 128).name})"
    return f"the program ended the test run abruptly (exit status {returncode})"


def run_program(program: str, suite: TestSuite, *, limits: SandboxLimits = DEFAULT_LIMITS) -> list[Execution]:
    """Run `program` on every test of `suite` in a sandbox; one Execution per test, in order.

    Raises SandboxUnavailable only when the sandbox cannot run here (the isolation level is missing,
    or the sandbox died before the first test: a broken installation, not a verdict on the program).
    """
    mode = isolation_level(limits)
    per_test = min(limits.per_test_s, suite.time_limit) if suite.time_limit else limits.per_test_s
    base = Path(tempfile.mkdtemp(prefix="sdpo-sandbox-"))
    proc: subprocess.Popen | None = None
    read_fd, write_fd = os.pipe()
    try:
        with memory_cgroup(limits.memory_mb) as cgroup_procs:
            os.chmod(base, 0o711)
            python = os.path.realpath(sys._base_executable)
            uid = random.randrange(*_UID_RANGE) if os.geteuid() == 0 else None
            tests = {
                "testtype": suite.testtype,
                "inputs": list(suite.inputs),  # inputs only: expected outputs never enter the sandbox
                "fn_name": suite.fn_name,
                "setup": suite.setup,
                "entry_points": list(suite.entry_points),
            }
            job = job_bytes(program, tests)
            run_limits = {
                "output_limit": limits.file_mb * MIB,
                "rlimits": rlimits(limits, set_nproc=uid is not None, cgroup=cgroup_procs is not None),
                "cgroup_procs": str(cgroup_procs) if cgroup_procs is not None and mode == "process" else None,
            }
            guard = "guard" if limits.python_guard else "noguard"
            if mode == "namespace":
                assert uid is not None  # namespace isolation needs root
                cmd, cwd = namespace_command(
                    base,
                    job,
                    python=python,
                    uid=uid,
                    result_fd=write_fd,
                    guard=guard,
                    limits=limits,
                    run_limits=run_limits,
                    cgroup_procs=cgroup_procs,
                )
            else:
                cmd, cwd = process_command(
                    base, job, python=python, uid=uid, result_fd=write_fd, guard=guard, run_limits=run_limits
                )
            with open(base / "stdout", "wb") as out, open(base / "stderr", "wb") as err:
                proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    pass_fds=(write_fd,),
                    start_new_session=True,
                    cwd=cwd,
                    env=scrubbed_env(cwd if mode == "process" else WORKDIR_IN_ROOT),
                )
            os.close(write_fd)
            write_fd = -1
            # one result line holds at most one test's output, JSON-escaped (up to 6 bytes per byte)
            reader = _Reader(read_fd, max_bytes=6 * limits.file_mb * MIB + (1 << 20))
            executions = _collect(proc, reader, n=len(suite.inputs), per_test=per_test, total=limits.total_s)
            _kill_group(proc)  # before the cgroup goes: nothing of the sandbox may outlive the run
            if executions is None:
                stderr = (base / "stderr").read_text(errors="replace")[-2000:]
                raise SandboxUnavailable(
                    f"the code sandbox ({mode}) failed before running any test "
                    f"({_exit_description(proc.returncode)}): {stderr}"
                )
            return executions
    finally:
        if proc is not None:
            _kill_group(proc)
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)
        shutil.rmtree(base, ignore_errors=True)


def _collect(
    proc: subprocess.Popen, reader: _Reader, *, n: int, per_test: float, total: float
) -> list[Execution] | None:
    """Read the harness's reports, enforcing the time limits; kill the run on overrun.

    Returns None when the sandbox died before starting the first test (a broken sandbox, not a
    verdict on the program).
    """
    started = time.monotonic()
    total_deadline = started + total
    results: dict[int, Execution] = {}
    current: int | None = None
    any_started = False
    test_deadline = started + min(total, _STARTUP_GRACE_S + per_test)
    stop: Execution | None = None
    while len(results) < n and stop is None and not reader.eof:
        deadline = min(total_deadline, test_deadline)
        messages = reader.read(deadline - time.monotonic())
        for message in messages:
            event, index = message.get("event"), message.get("index")
            if event == "start" and current is None and index == len(results):
                current, any_started = index, True
                test_deadline = time.monotonic() + per_test
            elif event == "result" and current is not None and index == current and _well_formed(message):
                results[current] = Execution(
                    index=current,
                    status=message["status"],
                    output=message["output"],
                    error=message["error"],
                    stderr=message["stderr"],
                )
                current = None
                test_deadline = time.monotonic() + per_test  # the next start must follow promptly
            elif event == "oversized":
                stop = Execution(
                    index=len(results),
                    status="error",
                    error="Output Limit Exceeded: the program's output overflowed the sandbox's report",
                )
                break
            else:
                stop = Execution(
                    index=len(results), status="error", error="the program corrupted the sandbox's report channel"
                )
                break
        if stop is None and not messages and not reader.eof and time.monotonic() >= deadline:
            limit = "total time limit" if deadline == total_deadline else "time limit"
            stop = Execution(index=len(results), status="timeout", error=f"{limit} exceeded")
    if len(results) < n and stop is None:  # the pipe closed early: the process died
        _kill_group(proc)
        if not any_started:
            return None
        stop = Execution(index=len(results), status="error", error=_exit_description(proc.returncode))
    if stop is not None:
        _kill_group(proc)
        results[stop.index] = stop
        for index in range(stop.index + 1, n):
            results[index] = Execution(index=index, status="not_run", error="not run: an earlier test stopped the run")
    return [results[i] for i in range(n)]


def _well_formed(message: dict) -> bool:
    return message.get("status") in EXEC_STATUSES and all(
        isinstance(message.get(key), str) for key in ("output", "error", "stderr")
    )


def runner(**limits: object) -> TestRunner:
    """A `run_tests` callable for `sdpo_core.verifiers.code.verify` with these SandboxLimits fields."""
    return partial(run_program, limits=SandboxLimits(**limits))  # type: ignore[arg-type]


def verify_code(
    response_text: str, label: str, *, truncated: bool, partial_credit: bool = False, **limits: object
) -> Verdict:
    """The code verifier wired to this sandbox: `verify(response_text, label, *, truncated, **kwargs)`."""
    return code_verifier.verify(
        response_text, label, truncated=truncated, run_tests=runner(**limits), partial_credit=partial_credit
    )
