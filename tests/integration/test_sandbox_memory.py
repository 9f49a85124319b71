"""The sandbox's memory cgroup (tasks/sandbox/memory.py) on this machine's real cgroup tree."""

from __future__ import annotations

import subprocess

import pytest

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
