"""Temporary entries carry their owner and are swept once it is gone; storage errors name the URL;
crash points kill only where armed; an uncommitted checkpoint is discarded manifest first."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from storage.errors import StorageIOError
from storage.layout import RunLayout, create_or_open_run
from storage.scratch import is_orphan, owner_tag, scratch_dir, sweep, sweep_local, tmp_sibling


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_entries_of_this_process_and_of_other_hosts_are_kept(tmp_path: Path) -> None:
    dead = _dead_pid()
    host = socket.gethostname()
    mine = tmp_path / f".LATEST.tmp{owner_tag()}"
    orphan_file = tmp_path / f".LATEST.tmp+{host}+{dead}+0123456789ab"
    orphan_dir = tmp_path / "tmp" / f"ckpt+{host}+{dead}+0123456789ab"
    elsewhere = tmp_path / f".run.json.tmp+other-host+{dead}+0123456789ab"
    plain = tmp_path / "part-00000.parquet"
    for path in (mine, orphan_file, elsewhere, plain):
        path.write_bytes(b"x")
    (orphan_dir / "megatron").mkdir(parents=True)
    (orphan_dir / "megatron" / "weights.bin").write_bytes(b"w" * 100)
    assert is_orphan(orphan_file.name) and is_orphan(orphan_dir.name)
    assert not is_orphan(mine.name) and not is_orphan(elsewhere.name) and not is_orphan(plain.name)
    removed = sweep(tmp_path, depth=2)
    assert sorted(removed) == sorted([orphan_file, orphan_dir])
    assert mine.exists() and elsewhere.exists() and plain.exists() and not orphan_dir.exists()


def test_sweep_local_covers_run_folder_cache_and_system_temp(tmp_path: Path) -> None:
    dead = _dead_pid()
    tag = f"+{socket.gethostname()}+{dead}+0123456789ab"
    run_dir = tmp_path / "runs" / "r" / "iter-3" / "rollout"
    run_dir.mkdir(parents=True)
    deep = run_dir / f".part-00000.parquet.tmp{tag}"
    cached = tmp_path / "cache" / f".{'a' * 64}.tmp{tag}"
    cached.mkdir(parents=True)
    spool = Path(os.environ.get("TMPDIR", "/tmp")) / f"sdpo-shard{tag}+x.parquet"
    for path in (deep, spool):
        path.write_bytes(b"x")
    removed = sweep_local(tmp_path / "cache", tmp_path / "runs" / "r")
    assert {deep, cached, spool} <= set(removed)
    assert not deep.exists() and not cached.exists() and not spool.exists()


def test_scratch_dir_is_removed_on_error_and_named_for_the_sweep(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), scratch_dir(tmp_path, "ckpt") as path:
        assert path.parent == tmp_path / "tmp" and path.name.startswith("ckpt+")
        (path / "f").write_bytes(b"x")
        raise RuntimeError("boom")
    assert not path.exists()
    assert os.path.basename(tmp_sibling("/a/b/LATEST")).startswith(".LATEST.tmp+")


def test_a_failed_local_write_removes_its_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = RunLayout(str(tmp_path / "runs"), "r")
    create_or_open_run(layout, {"lr": 1.0})
    real_fsync = os.fsync

    def full_disk(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(StorageIOError, match=r"write .*/runs/r/LATEST: No space left on device") as err:
        layout.store.write_bytes(layout.latest, b"{}")
    assert err.value.errno == errno.ENOSPC and isinstance(err.value, OSError)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert [p.name for p in Path(layout.store.path(layout.run_url)).iterdir()] == ["run.json"]


def test_crash_points_kill_the_process_group_only_where_armed() -> None:
    code = (
        "from storage.faults import crash_point\n"
        "crash_point('commit.start', 1)\n"
        "crash_point('commit.start', 2)\n"
        "print('unreachable')\n"
    )
    env = {**os.environ, "SDPO_CRASH_AT": "commit.start@2"}
    child = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, start_new_session=True
    )
    assert child.returncode == -signal.SIGKILL and "unreachable" not in child.stdout
    env["SDPO_CRASH_AT"] = "commit.start@7"
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).returncode == 0
    from storage.faults import crash_point

    with pytest.raises(ValueError, match="not in storage.faults.CRASH_POINTS"):
        crash_point("commit.strat", 1)


def test_an_uncommitted_checkpoint_is_discarded_manifest_first(tmp_path: Path) -> None:
    from storage.checkpoints import checkpoint_exists, discard_checkpoint, upload_checkpoint

    layout = RunLayout(str(tmp_path / "runs"), "r")
    create_or_open_run(layout, {"lr": 1.0})
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "model.safetensors").write_bytes(b"weights")
    upload_checkpoint(tmp_path / "w", layout, 2, "policy", parent="base")
    assert discard_checkpoint(layout, 2, "policy") and not checkpoint_exists(layout, 2, "policy")
    assert layout.store.list_files(layout.checkpoint_dir(2, "policy")) == []
    assert not discard_checkpoint(layout, 2, "policy")
    upload_checkpoint(tmp_path / "w", layout, 2, "policy", parent="base")  # the retry is not refused
