"""Run lock: one writer per run. A second writer fails fast and is told who holds the lock.

The lock is the object `<run>/LOCK` holding {host, pid, created_at, expires_at, token}. It is created
with the store's exclusive create (file: tmp + link(); s3: PUT If-None-Match: *; memory: under a
process lock), so of two writers exactly one succeeds. A lock is stale when its lease expired or,
on the same host, its process is gone. The lock of a process of this host that is gone is taken
over at once (that holder is certainly dead: a killed run resumes by running the same command
again), and so is an expired lease whose holder recorded a heartbeat (`heartbeat_seconds`): it
renewed the lease while alive, so an expired lease means it is gone. Any other expired lease is
taken over only with `force=True`, since its holder on another host may be alive but late to renew. Both take-overs are a compare-and-swap on the lock's content (s3: PUT If-Match: <etag>; file: flock + compare + rename).
Renewal and release are compare-and-swaps too, so a writer whose lock was taken over finds out.
Lease expiry compares wall clocks: hosts sharing a run need roughly synchronised clocks.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import socket
import threading
import uuid
from dataclasses import asdict, dataclass

from storage import anchor
from storage.errors import LockHeldError, PreconditionFailedError
from storage.layout import RunLayout
from storage.scratch import pid_alive

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LockHolder:
    host: str
    pid: int
    created_at: str
    expires_at: str
    token: str
    heartbeat_seconds: float | None = None  # renewed this often while alive; None: renewed by hand

    def describe(self) -> str:
        return f"host={self.host} pid={self.pid} created_at={self.created_at} lease expires {self.expires_at}"

    def stale_reason(self, *, now: dt.datetime | None = None) -> str | None:
        """Why the holder can be presumed dead, or None while it may be alive."""
        now = now or dt.datetime.now(dt.UTC)
        if dt.datetime.fromisoformat(self.expires_at) <= now:
            return f"lease expired at {self.expires_at}"
        if self.host == socket.gethostname() and not pid_alive(self.pid):
            return f"process {self.pid} on {self.host} is gone"
        return None


def read_lock_holder(layout: RunLayout) -> LockHolder | None:
    """The current holder of the run lock, or None when the run is unlocked."""
    if not layout.store.exists(layout.lock):
        return None
    return LockHolder(**json.loads(layout.store.read_bytes(layout.lock)))


class RunLock:
    """Exclusive writer lock on a run, held for `lease_seconds` and renewable.

    `heartbeat_seconds` starts a daemon thread renewing the lease that often (keep it well below
    `lease_seconds`). Use as a context manager, or call acquire()/release().
    """

    def __init__(
        self,
        layout: RunLayout,
        *,
        lease_seconds: float,
        force: bool = False,
        heartbeat_seconds: float | None = None,
    ) -> None:
        if lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be > 0, got {lease_seconds}")
        if heartbeat_seconds is not None and not 0 < heartbeat_seconds < lease_seconds:
            raise ValueError(f"need 0 < heartbeat_seconds < lease_seconds, got {heartbeat_seconds}, {lease_seconds}")
        self.layout = layout
        self.lease_seconds = lease_seconds
        self.force = force
        self.heartbeat_seconds = heartbeat_seconds
        self.holder: LockHolder | None = None
        self._tag: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost: BaseException | None = None

    def _record(self, *, token: str, created_at: str) -> tuple[LockHolder, bytes]:
        now = dt.datetime.now(dt.UTC)
        expires = now + dt.timedelta(seconds=self.lease_seconds)
        holder = LockHolder(
            host=socket.gethostname(),
            pid=os.getpid(),
            created_at=created_at,
            expires_at=expires.isoformat(timespec="milliseconds"),
            token=token,
            heartbeat_seconds=self.heartbeat_seconds,
        )
        return holder, json.dumps(asdict(holder), sort_keys=True).encode()

    def acquire(self) -> LockHolder:
        if self.holder is not None:
            raise RuntimeError(f"lock on run {self.layout.run_name!r} is already held by this RunLock")
        store, url = self.layout.store, self.layout.lock
        now = dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")
        holder, payload = self._record(token=uuid.uuid4().hex, created_at=now)
        for _ in range(3):  # the holder may release between our create and our read
            try:
                store.create_exclusive(url, payload)
                break
            except FileExistsError:
                pass
            try:
                self._take_over_stale(payload)
                break
            except FileNotFoundError:
                continue
        else:
            raise LockHeldError(f"run {self.layout.run_name!r}: lock kept changing while acquiring")
        data, self._tag = store.read_tagged(url)
        if data != payload:
            raise LockHeldError(f"run {self.layout.run_name!r}: lock changed right after it was taken: {data!r}")
        self.holder = holder
        logger.info("locked run %s (%s)", self.layout.run_name, holder.describe())
        if self.heartbeat_seconds is not None:
            self._stop.clear()
            name = f"run-lock-{self.layout.run_name}"
            self._thread = threading.Thread(target=self._heartbeat, name=name, daemon=True)
            self._thread.start()
        return holder

    def _take_over_stale(self, payload: bytes) -> None:
        store, url = self.layout.store, self.layout.lock
        data, tag = store.read_tagged(url)
        current = LockHolder(**json.loads(data))
        reason = current.stale_reason()
        if reason is None:
            raise LockHeldError(f"run {self.layout.run_name!r} is locked by {current.describe()}")
        dead = current.host == socket.gethostname() and not pid_alive(current.pid)
        silent = current.heartbeat_seconds is not None  # stale with a heartbeat: it stopped beating
        if not (self.force or dead or silent):
            raise LockHeldError(
                f"run {self.layout.run_name!r} is locked by {current.describe()}, which looks stale ({reason}); "
                "take it over with force=True (the CLI: sdpo run --force-unlock)"
            )
        try:
            store.replace_if_tag(url, payload, tag)
        except PreconditionFailedError as exc:
            raise LockHeldError(f"run {self.layout.run_name!r}: the stale lock changed while taking it over") from exc
        logger.warning("took over stale lock of run %s from %s (%s)", self.layout.run_name, current.describe(), reason)

    def renew(self) -> LockHolder:
        """Extend the lease; LockHeldError if the lock was taken over meanwhile."""
        if self.holder is None or self._tag is None:
            raise RuntimeError("renew() on a RunLock that is not held")
        holder, payload = self._record(token=self.holder.token, created_at=self.holder.created_at)
        store, url = self.layout.store, self.layout.lock
        try:
            store.replace_if_tag(url, payload, self._tag)
        except (PreconditionFailedError, FileNotFoundError) as exc:
            now = read_lock_holder(self.layout)
            raise LockHeldError(f"run {self.layout.run_name!r}: lock lost, now held by {now}") from exc
        data, self._tag = store.read_tagged(url)
        if data != payload:
            raise LockHeldError(f"run {self.layout.run_name!r}: lock changed during renewal: {data!r}")
        self.holder = holder
        return holder

    def _heartbeat(self) -> None:
        assert self.heartbeat_seconds is not None
        while not self._stop.wait(self.heartbeat_seconds):
            try:
                self.renew()
            except LockHeldError as exc:
                logger.error("run lock heartbeat stopped: %s", exc)
                self._lost = exc
                return

    def release(self) -> None:
        """Delete the lock if it is still ours; LockHeldError if it was taken over (or a renewal failed)."""
        if self.holder is None or self._tag is None:
            return
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        tag, self.holder, self._tag = self._tag, None, None
        anchor.forget(self.layout.run_url)  # the recorded digests checked while this process wrote the run
        if self._lost is not None:
            raise LockHeldError(f"run {self.layout.run_name!r}: lock was lost while held") from self._lost
        try:
            self.layout.store.delete_if_tag(self.layout.lock, tag)
        except (PreconditionFailedError, FileNotFoundError) as exc:
            raise LockHeldError(
                f"run {self.layout.run_name!r}: lock was taken over while held, now {read_lock_holder(self.layout)}"
            ) from exc
        logger.info("unlocked run %s", self.layout.run_name)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.release()
