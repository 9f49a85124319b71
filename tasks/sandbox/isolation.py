"""How one code sandbox starts (see tasks/sandbox/program.py): the isolation level it gets, the
command line, environment and rlimits of its first process, and the job and harness files it reads.

`namespace_command` starts the harness's setup phase under `unshare` (new network, mount, pid, ipc
and uts namespaces; the harness builds the minimal root and drops to the sandbox's uid);
`process_command` starts its run phase as a plain child. Both copy the harness and the modules it
imports next to the job, readable only, and the job itself readable by root alone: the zygote drops
its uid before the judge reads the tests.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path
from typing import Literal

from tasks.sandbox.memory import address_space_budget

__all__ = [
    "HARNESS_FILES",
    "MIB",
    "WORKDIR_IN_ROOT",
    "SandboxLimits",
    "SandboxUnavailable",
    "isolation_level",
    "job_bytes",
    "namespace_command",
    "namespace_isolation_available",
    "process_command",
    "rlimits",
    "scrubbed_env",
]

logger = logging.getLogger(__name__)

Isolation = Literal["auto", "namespace", "process"]

MIB = 2**20
HARNESS_FILES = (
    (Path(__file__).with_name("harness.py"), "harness.py"),
    *(
        (Path(__file__).with_name(f"{name}.py"), f"sandbox_{name}.py")
        for name in ("guard", "extensions", "codec", "runner", "judge")
    ),
)
WORKDIR_IN_ROOT = "/sandbox"


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


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run here: every answer would fail alike, so this stops the rollout."""


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


def isolation_level(limits: SandboxLimits) -> Literal["namespace", "process"]:
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


def rlimits(limits: SandboxLimits, *, set_nproc: bool, cgroup: bool) -> dict[str, int]:
    # Without a uid of its own RLIMIT_NPROC cannot bind the sandbox; the guard (mandatory then)
    # refuses fork to the program, which leaves the judge, the zygote and one call process.
    processes = limits.nproc if set_nproc else 3
    out = {
        "RLIMIT_AS": address_space_budget(limits.memory_mb, processes=processes, cgroup=cgroup),
        "RLIMIT_STACK": limits.stack_mb * MIB,
        "RLIMIT_FSIZE": limits.file_mb * MIB,
        "RLIMIT_NOFILE": limits.nofile,
        "RLIMIT_CPU": int(limits.total_s) + 1,
    }
    if set_nproc:  # counted per uid: only meaningful when the sandbox has a uid of its own
        out["RLIMIT_NPROC"] = limits.nproc
    return out


def scrubbed_env(home: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


def job_bytes(program: str, tests: dict) -> bytes:
    """The job file: the program first, behind its length, so the judge can fork the zygote after
    reading it and before reading the tests."""
    head = json.dumps({"code": program}).encode()
    return b"%d\n" % len(head) + head + json.dumps(tests).encode()


def write_job(folder: Path, job: bytes) -> None:
    """The job (readable by root only: the zygote drops its uid before the judge reads the tests)
    and the harness with its modules."""
    (folder / "job.json").write_bytes(job)
    os.chmod(folder / "job.json", 0o400)
    for source, name in HARNESS_FILES:
        shutil.copyfile(source, folder / name)
        os.chmod(folder / name, 0o444)


def namespace_command(
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
    write_job(root, job)
    prefix = os.path.realpath(sys.base_prefix)
    binds = ["/usr"] + ([] if prefix.startswith("/usr/") else [prefix])
    symlinks = {name: os.readlink(f"/{name}") for name in ("bin", "lib", "lib64", "sbin") if os.path.islink(f"/{name}")}
    binds += [f"/{name}" for name in ("lib", "lib64") if os.path.isdir(f"/{name}") and name not in symlinks]
    config = {
        "root": str(root),
        "uid": uid,
        "binds": binds,
        "symlinks": symlinks,
        "workdir": WORKDIR_IN_ROOT,
        "tmpfs_bytes": limits.tmpfs_mb * MIB,
        "result_fd": result_fd,
        "python": python,
        "harness": "/harness.py",
        "job": "/job.json",
        "guard": guard,
        "limits": json.dumps(run_limits),
        "cgroup_procs": None if cgroup_procs is None else str(cgroup_procs),
        "env": scrubbed_env(WORKDIR_IN_ROOT),
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


def process_command(
    base: Path, job: bytes, *, python: str, uid: int | None, result_fd: int, guard: str, run_limits: dict
) -> tuple[list[str], str]:
    """The harness's run phase as a plain child, in a fresh working directory base/work."""
    work = base / "work"
    work.mkdir(mode=0o700)
    write_job(base, job)
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
