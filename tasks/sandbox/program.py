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

One module on purpose (longer than most): starting one sandbox, watching its pipe and killing
it are one sequence whose security argument reads top to bottom; the parts that stand alone (the
harness, zygote and call processes, guard, codec and memory limit) are modules of their own.
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
from dataclasses import dataclass
from functools import cache, lru_cache, partial
from pathlib import Path
from typing import Literal

from sdpo_core.records import Verdict
from sdpo_core.verifiers import code as code_verifier
from sdpo_core.verifiers.code import EXEC_STATUSES, Execution, TestRunner, TestSuite
from tasks.sandbox.memory import address_space_budget, memory_cgroup

__all__ = [
    "SandboxLimits",
    "SandboxUnavailable",
    "namespace_isolation_available",
    "run_program",
    "runner",
    "verify_code",
]

logger = logging.getLogger(__name__)

Isolation = Literal["auto", "namespace", "process"]
# the harness and the modules it imports, as (file here, name inside the sandbox)
_HARNESS_FILES = (
    (Path(__file__).with_name("harness.py"), "harness.py"),
    *(
        (Path(__file__).with_name(f"{name}.py"), f"sandbox_{name}.py")
        for name in ("guard", "extensions", "codec", "runner")
    ),
)
_WORKDIR_IN_ROOT = "/sandbox"
_UID_RANGE = (200_000, 260_000)  # unprivileged uids no account uses; a random one per run
_STARTUP_GRACE_S = 5.0  # interpreter start before the first test; counts against total_s only
_MIB = 2**20


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run here: every answer would fail alike, so this stops the rollout."""


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Resource limits of one sandboxed run.

    `per_test_s` is the wall-clock limit of one test (a suite's own `time_limit` may lower it);
    `total_s` bounds the whole run, interpreter start included. `memory_mb` bounds the memory of
    the whole sandbox (a cgroup, else an RLIMIT_AS budget of memory_mb / nproc per process),
    `file_mb` RLIMIT_FSIZE and the cap on one test's captured output, `tmpfs_mb` the size of the
    working directory (namespace isolation), `nproc` RLIMIT_NPROC (processes and threads, the
    judge, the zygote and the call process included). Each value must be of its type and within
    `_RANGES` (seconds finite and over 0).
    """

    per_test_s: float = 6.0
    total_s: float = 60.0
    memory_mb: int = 1024
    stack_mb: int = 64
    file_mb: int = 16
    tmpfs_mb: int = 64
    nproc: int = 8
    nofile: int = 64
    isolation: Isolation = "auto"
    python_guard: bool = True

    def __post_init__(self) -> None:
        for name, (low, high) in _RANGES.items():
            value = getattr(self, name)
            seconds = name.endswith("_s")
            if isinstance(value, bool) or not isinstance(value, (int, float) if seconds else int):
                what = "a number of seconds" if seconds else "an integer"
                raise TypeError(f"SandboxLimits.{name} must be {what}, got {value!r}")
            inside = low < value <= high if seconds else low <= value <= high  # false for nan too
            if not inside:
                raise ValueError(f"SandboxLimits.{name} must be in {_range_text(name)}, got {value!r}")
        if self.isolation not in ("auto", "namespace", "process"):
            raise ValueError(f"isolation must be auto, namespace or process, got {self.isolation!r}")
        if not isinstance(self.python_guard, bool):
            raise TypeError(f"SandboxLimits.python_guard must be true or false, got {self.python_guard!r}")
        if self.isolation == "process" and not self.python_guard:
            raise ValueError(
                "isolation='process' relies on the Python guard; python_guard=False is only allowed with namespaces"
            )


# The bounds of each limit (a config naming a value outside them fails while loading). nproc counts
# the judge, the zygote and a call process; nofile the descriptors each of them holds.
_RANGES: dict[str, tuple[float, float]] = {
    "per_test_s": (0.0, 3600.0),
    "total_s": (0.0, 86_400.0),
    "memory_mb": (1, 1 << 20),
    "stack_mb": (1, 1 << 16),
    "file_mb": (1, 1024),
    "tmpfs_mb": (1, 1 << 20),
    "nproc": (3, 4096),
    "nofile": (16, 1 << 20),
}


def _range_text(name: str) -> str:
    low, high = _RANGES[name]
    return f"(0, {high:g}] seconds" if name.endswith("_s") else f"[{int(low)}, {int(high)}]"


@lru_cache(maxsize=1)
def namespace_isolation_available() -> bool:
    """True when this process can build the namespace sandbox (Linux, root, a working `unshare`)."""
    unshare = shutil.which("unshare")
    if sys.platform != "linux" or os.geteuid() != 0 or unshare is None:
        return False
    probe = subprocess.run(
        [unshare, "--net", "--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "true"],
        capture_output=True,
        timeout=10,
    )
    if probe.returncode != 0:
        logger.info("unshare probe failed (%s): %s", probe.returncode, probe.stderr.decode(errors="replace").strip())
    return probe.returncode == 0


def _isolation(limits: SandboxLimits) -> Literal["namespace", "process"]:
    if limits.isolation == "process":
        _warn_once(
            "code sandbox: isolation='process' runs model-written code as a plain process with rlimits, an "
            "unprivileged uid (as root) and the Python-level guard; a crafted bytecode exploit of the interpreter "
            "could bypass the guard"
        )
        return "process"
    if namespace_isolation_available():
        return "namespace"
    raise SandboxUnavailable(
        f"isolation={limits.isolation!r} needs namespace isolation (Linux, root, a working `unshare`), unavailable "
        "here; run as root in a container, or accept the weaker plain-process sandbox by naming it: "
        "verifier.kwargs.isolation=process"
    )


@cache
def _warn_once(message: str) -> None:
    logger.warning(message)


def _rlimits(limits: SandboxLimits, *, set_nproc: bool, cgroup: bool) -> dict[str, int]:
    # Without a uid of its own RLIMIT_NPROC cannot bind the sandbox; the guard (mandatory then)
    # refuses fork to the program, which leaves the judge, the zygote and one call process.
    processes = limits.nproc if set_nproc else 3
    out = {
        "RLIMIT_AS": address_space_budget(limits.memory_mb, processes=processes, cgroup=cgroup),
        "RLIMIT_STACK": limits.stack_mb * _MIB,
        "RLIMIT_FSIZE": limits.file_mb * _MIB,
        "RLIMIT_NOFILE": limits.nofile,
        "RLIMIT_CPU": int(limits.total_s) + 1,
    }
    if set_nproc:  # counted per uid: only meaningful when the sandbox has a uid of its own
        out["RLIMIT_NPROC"] = limits.nproc
    return out


def _scrubbed_env(home: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


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


def run_program(program: str, suite: TestSuite, *, limits: SandboxLimits = SandboxLimits()) -> list[Execution]:
    """Run `program` on every test of `suite` in a sandbox; one Execution per test, in order.

    Raises SandboxUnavailable only when the sandbox cannot run here (the isolation level is missing,
    or the sandbox died before the first test: a broken installation, not a verdict on the program).
    """
    mode = _isolation(limits)
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
            job = _job_bytes(program, tests)
            run_limits = {
                "output_limit": limits.file_mb * _MIB,
                "rlimits": _rlimits(limits, set_nproc=uid is not None, cgroup=cgroup_procs is not None),
                "cgroup_procs": str(cgroup_procs) if cgroup_procs is not None and mode == "process" else None,
            }
            guard = "guard" if limits.python_guard else "noguard"
            if mode == "namespace":
                assert uid is not None  # namespace isolation needs root
                cmd, cwd = _namespace_command(
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
                cmd, cwd = _process_command(
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
                    env=_scrubbed_env(cwd if mode == "process" else _WORKDIR_IN_ROOT),
                )
            os.close(write_fd)
            write_fd = -1
            # one result line holds at most one test's output, JSON-escaped (up to 6 bytes per byte)
            reader = _Reader(read_fd, max_bytes=6 * limits.file_mb * _MIB + (1 << 20))
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


def _job_bytes(program: str, tests: dict) -> bytes:
    """The job file: the program first, behind its length, so the judge can fork the zygote after
    reading it and before reading the tests."""
    head = json.dumps({"code": program}).encode()
    return b"%d\n" % len(head) + head + json.dumps(tests).encode()


def _write_job(folder: Path, job: bytes) -> None:
    """The job (readable by root only: the zygote drops its uid before the judge reads the tests)
    and the harness with its modules."""
    (folder / "job.json").write_bytes(job)
    os.chmod(folder / "job.json", 0o400)
    for source, name in _HARNESS_FILES:
        shutil.copyfile(source, folder / name)
        os.chmod(folder / name, 0o444)


def _namespace_command(
    base: Path,
    job: bytes,
    *,
    python: str,
    uid: int,
    result_fd: int,
    guard: str,
    limits: SandboxLimits,
    run_limits: dict,
    cgroup_procs: Path | None,
) -> tuple[list[str], str]:
    """`unshare` + the harness's setup phase, which builds the minimal root under base/root."""
    root = base / "root"
    root.mkdir(mode=0o755)
    _write_job(root, job)
    prefix = os.path.realpath(sys.base_prefix)
    binds = ["/usr"] + ([] if prefix.startswith("/usr/") else [prefix])
    symlinks = {name: os.readlink(f"/{name}") for name in ("bin", "lib", "lib64", "sbin") if os.path.islink(f"/{name}")}
    binds += [f"/{name}" for name in ("lib", "lib64") if os.path.isdir(f"/{name}") and name not in symlinks]
    config = {
        "root": str(root),
        "uid": uid,
        "binds": binds,
        "symlinks": symlinks,
        "workdir": _WORKDIR_IN_ROOT,
        "tmpfs_bytes": limits.tmpfs_mb * _MIB,
        "result_fd": result_fd,
        "python": python,
        "harness": "/harness.py",
        "job": "/job.json",
        "guard": guard,
        "limits": json.dumps(run_limits),
        "cgroup_procs": None if cgroup_procs is None else str(cgroup_procs),
        "env": _scrubbed_env(_WORKDIR_IN_ROOT),
    }
    unshare = shutil.which("unshare")
    assert unshare is not None  # checked by namespace_isolation_available
    cmd = [
        unshare,
        "--net",
        "--mount",
        "--pid",
        "--ipc",
        "--uts",
        "--fork",
        "--kill-child",
        "--",
        python,
        "-I",
        "-S",
        "-B",
        str(root / "harness.py"),
        "setup",
        json.dumps(config),
    ]
    return cmd, str(base)


def _process_command(
    base: Path, job: bytes, *, python: str, uid: int | None, result_fd: int, guard: str, run_limits: dict
) -> tuple[list[str], str]:
    """The harness's run phase as a plain child, in a fresh working directory base/work."""
    work = base / "work"
    work.mkdir(mode=0o700)
    _write_job(base, job)
    if uid is not None:
        os.chown(work, uid, uid)
    cmd = [
        python,
        "-I",
        "-S",
        "-B",
        str(base / "harness.py"),
        "start",
        str(base / "job.json"),
        str(result_fd),
        guard,
        "-" if uid is None else str(uid),
        json.dumps(run_limits),
    ]
    return cmd, str(work)


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
