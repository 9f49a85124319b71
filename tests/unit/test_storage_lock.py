"""Run lock: exclusive, fails fast naming the holder, a dead local holder's lock taken over, an expired lease without force only when its holder heartbeated, lease renewal."""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from storage import LockHeldError, RunLayout, RunLock, read_lock_holder


@pytest.fixture(params=["memory", "file"])
def layout(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RunLayout]:
    root = str(tmp_path / "runs") if request.param == "file" else f"memory://test-{uuid.uuid4().hex}"
    yield RunLayout(root, "run")
    memory = fsspec.filesystem("memory")
    if request.param == "memory" and memory.exists(root):
        memory.rm(root, recursive=True)


def _plant(
    layout: RunLayout, *, host: str, pid: int, expires_in_s: float, heartbeat_seconds: float | None = None
) -> None:
    now = dt.datetime.now(dt.UTC)
    record = {
        "host": host,
        "pid": pid,
        "created_at": now.isoformat(),
        "expires_at": (now + dt.timedelta(seconds=expires_in_s)).isoformat(),
        "token": "planted",
    }
    if heartbeat_seconds is not None:
        record["heartbeat_seconds"] = heartbeat_seconds
    layout.store.write_bytes(layout.lock, json.dumps(record).encode())


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_second_writer_fails_fast_naming_the_holder(layout: RunLayout) -> None:
    with RunLock(layout, lease_seconds=60) as first:
        holder = read_lock_holder(layout)
        assert holder == first.holder and holder is not None
        assert holder.host == socket.gethostname() and holder.pid == os.getpid()
        started = time.monotonic()
        with pytest.raises(LockHeldError) as info:
            RunLock(layout, lease_seconds=60).acquire()
        assert time.monotonic() - started < 1.0
        message = str(info.value)
        assert f"host={holder.host}" in message and f"pid={holder.pid}" in message
        assert holder.created_at in message and holder.expires_at in message
    assert read_lock_holder(layout) is None
    with RunLock(layout, lease_seconds=60):  # free again after release
        pass


def test_only_one_of_many_racing_writers_gets_the_lock(layout: RunLayout) -> None:
    winners, losers = [], []
    barrier = threading.Barrier(8)

    def contend() -> None:
        lock = RunLock(layout, lease_seconds=60)
        barrier.wait()
        try:
            lock.acquire()
            winners.append(lock)
        except LockHeldError:
            losers.append(lock)

    threads = [threading.Thread(target=contend) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1 and len(losers) == 7
    winners[0].release()


def test_expired_lease_is_taken_over_only_with_force(layout: RunLayout) -> None:
    _plant(layout, host="other-host", pid=1, expires_in_s=-5)
    with pytest.raises(
        LockHeldError,
        match="looks stale \\(lease expired at .*\\); take it over with force=True \\(the CLI: sdpo run --force-unlock\\)",
    ):
        RunLock(layout, lease_seconds=60).acquire()
    with RunLock(layout, lease_seconds=60, force=True) as lock:
        assert read_lock_holder(layout) == lock.holder and lock.holder.token != "planted"


def test_expired_lease_of_a_heartbeating_holder_is_taken_over_without_force(layout: RunLayout, caplog) -> None:
    # another host, liveness unknown: but it renewed every 15 s while alive and its lease expired
    _plant(layout, host="other-host", pid=1, expires_in_s=-5, heartbeat_seconds=15)
    with caplog.at_level("WARNING", logger="storage.lock"), RunLock(layout, lease_seconds=60) as lock:
        assert read_lock_holder(layout) == lock.holder and lock.holder.token != "planted"
    assert (
        "took over stale lock" in caplog.text
        and "host=other-host pid=1" in caplog.text
        and "lease expired" in caplog.text
    )


def test_a_heartbeating_holder_whose_lease_is_valid_keeps_its_lock(layout: RunLayout) -> None:
    _plant(layout, host="other-host", pid=1, expires_in_s=60, heartbeat_seconds=15)
    with pytest.raises(LockHeldError, match="locked by host=other-host pid=1"):
        RunLock(layout, lease_seconds=60).acquire()


def test_lock_of_a_dead_process_on_this_host_is_taken_over_without_force(layout: RunLayout, caplog) -> None:
    pid = _dead_pid()
    _plant(layout, host=socket.gethostname(), pid=pid, expires_in_s=3600)
    with caplog.at_level("WARNING", logger="storage.lock"), RunLock(layout, lease_seconds=60) as lock:
        assert read_lock_holder(layout) == lock.holder and lock.holder.token != "planted"
    assert f"process {pid} on" in caplog.text and "is gone" in caplog.text


def test_force_does_not_break_a_live_lock(layout: RunLayout) -> None:
    _plant(layout, host="other-host", pid=1, expires_in_s=3600)  # other host: liveness unknown, lease valid
    with pytest.raises(LockHeldError, match="locked by host=other-host pid=1"):
        RunLock(layout, lease_seconds=60, force=True).acquire()


def test_renew_extends_the_lease(layout: RunLayout) -> None:
    with RunLock(layout, lease_seconds=30) as lock:
        before = lock.holder.expires_at
        time.sleep(0.01)
        after = lock.renew()
        assert after.expires_at > before and after.token == lock.holder.token
        assert read_lock_holder(layout) == after


def test_writer_whose_lock_was_taken_over_finds_out(layout: RunLayout) -> None:
    lock = RunLock(layout, lease_seconds=0.05)
    lock.acquire()
    time.sleep(0.1)  # lease runs out
    thief = RunLock(layout, lease_seconds=60, force=True)
    thief.acquire()
    with pytest.raises(LockHeldError, match="lock lost"):
        lock.renew()
    with pytest.raises(LockHeldError, match="taken over"):
        lock.release()
    assert read_lock_holder(layout) == thief.holder  # the loser did not delete the new holder's lock
    thief.release()


def test_heartbeat_keeps_a_short_lease_alive(layout: RunLayout) -> None:
    # a lease much shorter than the wait: only the heartbeat keeps it alive (margins for a busy machine)
    with RunLock(layout, lease_seconds=1.5, heartbeat_seconds=0.1) as lock:
        first = read_lock_holder(layout)
        assert first.heartbeat_seconds == 0.1  # recorded: a later writer may treat an expired lease as dead
        time.sleep(2.0)
        assert read_lock_holder(layout).expires_at > first.expires_at
        assert read_lock_holder(layout).stale_reason() is None
        with pytest.raises(LockHeldError):
            RunLock(layout, lease_seconds=60, force=True).acquire()
        assert lock.holder is not None
    assert read_lock_holder(layout) is None


def test_lock_file_lives_in_the_run_directory(layout: RunLayout) -> None:
    with RunLock(layout, lease_seconds=60):
        assert layout.store.exists(layout.lock) and layout.lock.endswith("/run/LOCK")


def test_lease_must_be_positive(layout: RunLayout) -> None:
    with pytest.raises(ValueError, match="lease_seconds"):
        RunLock(layout, lease_seconds=0)
    with pytest.raises(ValueError, match="heartbeat_seconds"):
        RunLock(layout, lease_seconds=1, heartbeat_seconds=2)
