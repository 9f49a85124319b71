"""One memory limit for a whole code sandbox (see tasks/sandbox/program.py).

Where this process may create memory cgroups and limit them (root with a writable cgroup v1
`memory` hierarchy, or a cgroup v2 tree that delegates the memory controller; a probe cgroup is
created and limited once to find out), every sandbox gets a cgroup of its own whose limit
is `memory_mb`, swap included: the judge, the zygote, its call processes and anything they start share it. Elsewhere
the limit is split into a budget: each of the at most `processes` processes of the sandbox gets
RLIMIT_AS = memory_mb / processes, so together they can never map more than `memory_mb`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import time
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

__all__ = ["MIN_PROCESS_MB", "address_space_budget", "memory_cgroup", "memory_cgroup_parent"]

logger = logging.getLogger(__name__)

_MIB = 2**20
MIN_PROCESS_MB = 32  # the interpreter alone needs about 16 MiB of address space
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_REMOVE_WAIT_S = 2.0  # the kernel drops exited processes from a cgroup asynchronously


def _own_cgroup(hierarchy: str) -> str | None:
    """This process's cgroup path in the hierarchy whose /proc/self/cgroup key is `hierarchy`."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == hierarchy:
            return path
    return None


@lru_cache(maxsize=1)
def memory_cgroup_parent() -> tuple[Path, int] | None:
    """(folder to create sandbox cgroups in, cgroup version), or None where that is not possible."""
    if os.geteuid() != 0 or not Path("/proc/self/cgroup").exists():
        return None
    v2 = _CGROUP_ROOT / "cgroup.controllers"
    candidates: list[tuple[Path, int]] = []
    if v2.exists() and "memory" in v2.read_text().split():
        own = _own_cgroup("")
        if own is not None:
            candidates.append((_CGROUP_ROOT / own.lstrip("/"), 2))
    v1 = _CGROUP_ROOT / "memory"
    if (v1 / "memory.limit_in_bytes").exists():
        own = _own_cgroup("memory")
        if own is not None:
            candidates.append((v1 / own.lstrip("/"), 1))
        candidates.append((v1, 1))
    for folder, version in candidates:
        if folder.is_dir() and os.access(folder, os.W_OK):
            probe = folder / f"sdpo-probe-{secrets.token_hex(4)}"
            try:
                probe.mkdir()
            except OSError as err:
                logger.info("cannot create memory cgroups under %s: %s", folder, err)
                continue
            try:
                _set_limit(probe, version, None)
            except OSError as err:  # e.g. a v2 tree whose parent does not delegate the memory controller
                logger.info("cannot limit the memory of cgroups under %s: %s", folder, err)
                continue
            finally:
                probe.rmdir()
            return folder, version
    return None


def _set_limit(group: Path, version: int, limit_mb: int | None) -> None:
    """Write `group`'s memory limit (None: unlimited), swap included where the kernel accounts it.
    OSError where the files are missing or not writable: a folder made in a cgroup tree gets the
    memory files only when its parent enables the memory controller for its children."""
    if version == 2:
        limit = "max" if limit_mb is None else str(limit_mb * _MIB)
        _write_existing(group / "memory.max", limit)
        if (group / "memory.swap.max").exists():
            _write_existing(group / "memory.swap.max", "0")
    else:
        limit = "-1" if limit_mb is None else str(limit_mb * _MIB)
        _write_existing(group / "memory.limit_in_bytes", limit)
        if (group / "memory.memsw.limit_in_bytes").exists():  # only with swap accounting on
            _write_existing(group / "memory.memsw.limit_in_bytes", limit)


def _write_existing(path: Path, value: str) -> None:
    """Write a cgroup control file, which must exist (opening it never creates one)."""
    with path.open("r+", encoding="ascii") as control:
        control.write(value)


@contextlib.contextmanager
def memory_cgroup(limit_mb: int) -> Iterator[Path | None]:
    """A fresh memory cgroup limited to `limit_mb` (swap included); yields its `cgroup.procs` file,
    or None where cgroups are unavailable. On exit every process still in it is killed (so nothing
    that left the sandbox's process group outlives the run) and the cgroup is removed."""
    parent = memory_cgroup_parent()
    if parent is None:
        yield None
        return
    folder, version = parent
    group = folder / f"sdpo-sandbox-{secrets.token_hex(8)}"
    group.mkdir()
    try:
        _set_limit(group, version, limit_mb)
        yield group / "cgroup.procs"
    finally:
        deadline = time.monotonic() + _REMOVE_WAIT_S
        while True:
            for pid in (group / "cgroup.procs").read_text().split():  # e.g. a runner that left its group
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass  # it exited meanwhile
            try:
                group.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)


def address_space_budget(memory_mb: int, *, processes: int, cgroup: bool) -> int:
    """RLIMIT_AS in bytes for each process of a sandbox that may hold `processes` processes."""
    per_process = memory_mb if cgroup else memory_mb // processes
    if per_process < MIN_PROCESS_MB:
        raise ValueError(
            f"memory_mb={memory_mb} split over {processes} processes leaves {per_process} MiB each "
            f"(under {MIN_PROCESS_MB}); raise memory_mb or lower nproc"
        )
    return per_process * _MIB
