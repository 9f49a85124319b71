"""The sandbox's memory cgroup (tasks/sandbox/memory.py) on this machine's real cgroup tree."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tasks.sandbox import memory
from tasks.sandbox.memory import address_space_budget, memory_cgroup, memory_cgroup_parent

needs_cgroups = pytest.mark.skipif(memory_cgroup_parent() is None, reason="needs root and a memory cgroup tree")


@needs_cgroups
def test_the_cgroup_holds_the_limit_and_is_removed_with_whatever_is_left_in_it():
    with memory_cgroup(96) as procs:
        assert procs is not None
        folder = procs.parent
        limit_file = "memory.max" if (folder / "memory.max").exists() else "memory.limit_in_bytes"
        assert int((folder / limit_file).read_text()) == 96 * 2**20
        left_behind = subprocess.Popen(["sleep", "30"], start_new_session=True)
        procs.write_text(str(left_behind.pid))
    assert left_behind.wait(timeout=5) == -9
    assert not folder.exists()


def test_without_a_cgroup_the_budget_is_split_over_the_processes():
    assert address_space_budget(1024, processes=8, cgroup=False) == 128 * 2**20
    assert address_space_budget(1024, processes=8, cgroup=True) == 1024 * 2**20
    with pytest.raises(ValueError, match="raise memory_mb or lower nproc"):
        address_space_budget(128, processes=8, cgroup=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="the probe only runs as root")
def test_a_tree_whose_cgroups_cannot_be_limited_falls_back_to_the_budget(tmp_path, monkeypatch):
    """A cgroup v2 tree that lets this process create folders but does not delegate the memory
    controller to them (as in some containers) gives them no memory.max: writing the limit fails
    with EACCES. The probe must find that out and the sandbox fall back to RLIMIT_AS budgets,
    rather than every answer's verification failing."""
    own = next(
        line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::")
    )
    tree = tmp_path / "cgroup"
    (tree / own.lstrip("/")).mkdir(parents=True, exist_ok=True)
    (tree / "cgroup.controllers").write_text("cpu io memory pids\n")
    monkeypatch.setattr(memory, "_CGROUP_ROOT", tree)
    memory_cgroup_parent.cache_clear()
    try:
        assert memory_cgroup_parent() is None
        assert [p.name for p in (tree / own.lstrip("/")).iterdir() if p.name.startswith("sdpo-")] == []
        with memory_cgroup(96) as procs:
            assert procs is None
    finally:
        memory_cgroup_parent.cache_clear()
