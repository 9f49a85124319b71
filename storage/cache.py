"""The local checkpoint cache: verified copies of checkpoints, shared by every process on a machine.

`<cache_dir>/<manifest digest>/` holds the files of one checkpoint; a download lands in a temporary
folder renamed into place when complete. With a byte bound the least recently used checkpoints are
evicted, but never one a process is reading: runs started side by side share one cache, and one
run's eviction must not remove the folder another run's engine or trainer is loading.

Pins make that so. Reading a cached checkpoint holds a shared `flock` on `<cache_dir>/pins/<digest>`;
eviction takes the exclusive lock without waiting and skips the checkpoint when it cannot. Inside
`pinned_cache()` (every stage body runs in one) the pins of the folders handed out last until the
block ends; outside it a pin covers the call only. The kernel drops a killed process's locks, so a
crash never leaves a checkpoint pinned.

Checking a cached copy against its manifest hashes its files, and a process hashes each file once:
it remembers the sha256 of every file it hashed, downloaded with verification or moved in from its
own upload, with the file's identity (device, inode, size, modification time in ns). A file still
of that identity is not read again by this process; a write changes its modification time and a
replacement its inode, so either is hashed again, and every new process hashes each file once.
"""

from __future__ import annotations

import contextlib
import contextvars
import fcntl
import hashlib
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from storage.checkpoints import checkpoint_iteration, resolve_checkpoint
from storage.errors import ChecksumMismatchError
from storage.hashing import sha256_local_file
from storage.layout import RunLayout
from storage.manifest import Manifest
from storage.retention import check_not_pruned
from storage.scratch import owner_tag

logger = logging.getLogger(__name__)

PINS = "pins"
PARTIAL_PREFIX = "files-"  # folders of part of a checkpoint (`download_checkpoint_files`)
_SCOPE: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("sdpo_cache_pins", default=None)
# path -> (the file's identity when its sha256 was known, that sha256); see the module docstring
_HASHED: dict[str, tuple[tuple[int, int, int, int], str]] = {}


def _identity(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _remember_sha256(path: Path, digest: str) -> None:
    """`path` holds bytes of sha256 `digest` (this process hashed them as it wrote or moved them)."""
    _HASHED[str(path)] = (_identity(path), digest)


def _sha256(path: Path) -> str:
    """The sha256 of a local file, read only when this process has not hashed it as it is now."""
    known = _HASHED.get(str(path))
    identity = _identity(path)
    if known is not None and known[0] == identity:
        return known[1]
    digest = sha256_local_file(path)
    _HASHED[str(path)] = (identity, digest)
    return digest


def forget_hashes() -> None:
    """Forget every sha256 this process knows (the next check of each file reads it)."""
    _HASHED.clear()


# -- pins ------------------------------------------------------------------------------------
def _pin_path(cache: Path, digest: str) -> Path:
    return cache / PINS / digest


def _lock(path: Path, operation: int) -> int | None:
    """An open descriptor holding `flock(operation)` on `path`, or None when a non-blocking lock is
    refused. An evictor unlinks a pin file while holding it exclusively, so a lock won on a file
    that is no longer at `path` is dropped and taken again on the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, operation)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = -1
        if current == os.fstat(fd).st_ino:
            return fd
        os.close(fd)


@contextlib.contextmanager
def pinned_cache() -> Iterator[None]:
    """Keep every checkpoint folder handed out in this block from eviction until it ends."""
    held: list[int] = []
    token = _SCOPE.set(held)
    try:
        yield
    finally:
        _SCOPE.reset(token)
        for fd in held:
            os.close(fd)


@contextlib.contextmanager
def _pin(cache: Path, digest: str) -> Iterator[int]:
    """A shared pin on `digest` for the call, handed to the enclosing `pinned_cache()` if any."""
    path = _pin_path(cache, digest)
    fd = _lock(path, fcntl.LOCK_SH)
    assert fd is not None  # a blocking lock is never refused
    scope = _SCOPE.get()
    try:
        yield fd
    except BaseException:
        if not (cache / digest).is_dir():  # nothing cached to pin: drop the file unless others wait
            with contextlib.suppress(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.unlink(path)
        os.close(fd)
        raise
    if scope is None:
        os.close(fd)
    else:
        scope.append(fd)


# -- copies ----------------------------------------------------------------------------------
def _local_copy_problem(folder: Path, manifest: Manifest, *, verify: bool) -> str | None:
    expected = {e["name"]: e for e in manifest.data["files"]}
    present = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    if present != set(expected):
        missing, extra = sorted(set(expected) - present)[:3], sorted(present - set(expected))[:3]
        return f"files differ: missing {missing}, extra {extra}"
    for name, entry in expected.items():
        path = folder / name
        if path.stat().st_size != entry["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, manifest says {entry['bytes']}"
        if verify and _sha256(path) != entry["sha256"]:
            return f"{name} sha256 differs from the manifest"
    return None


def _fetch(layout: RunLayout, manifest: Manifest, target: Path, *, verify: bool) -> None:
    """Download the checkpoint's files into a temporary folder and rename it to `target`."""
    tmp = target.parent / f".{manifest.sha256}.tmp{owner_tag()}"
    try:
        for entry in manifest.data["files"]:
            url = layout.url(entry["path"])
            local = tmp / entry["name"]
            copied = layout.store.get_to_local(url, local)
            if verify and (actual := copied or sha256_local_file(local)) != entry["sha256"]:
                raise ChecksumMismatchError(url, expected=entry["sha256"], actual=actual)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished the same download first
            if not target.is_dir():
                raise
            logger.info("checkpoint %s appeared in the cache meanwhile; using it", target)
        else:
            if verify:  # every file was checked as it arrived; a rename keeps its identity
                for entry in manifest.data["files"]:
                    _remember_sha256(target / entry["name"], entry["sha256"])
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def download_checkpoint(
    layout: RunLayout,
    ref: str | int,
    kind: str = "policy",
    *,
    cache_dir: str | os.PathLike[str],
    verify: bool = True,
    max_cache_bytes: int | None = None,
) -> Path:
    """Local folder holding checkpoint `ref`: `<cache_dir>/<manifest digest>/`, downloaded if needed.

    A cached copy is reused after checking it against the manifest (sha256 when `verify`); a damaged
    one is downloaded again. The folder is pinned (see the module docstring). With `max_cache_bytes`,
    the least recently used unpinned checkpoints are evicted after a download until the cache fits.
    """
    manifest = resolve_checkpoint(layout, ref, kind)
    check_not_pruned(layout, checkpoint_iteration(layout, ref), kind)
    cache = Path(cache_dir)
    target = cache / manifest.sha256
    with _pin(cache, manifest.sha256) as fd:
        if target.is_dir():
            problem = _local_copy_problem(target, manifest, verify=verify)
            if problem is None:
                logger.info("checkpoint %s %s: using cached %s", kind, ref, target)
                os.utime(target)  # recently used: the last to be evicted from a bounded cache
                return target
            # remove it alone: other readers of the damaged copy hold shared pins until they let go
            fcntl.flock(fd, fcntl.LOCK_EX)
            if (problem := _local_copy_problem(target, manifest, verify=verify)) is not None:
                logger.warning("cached checkpoint %s is damaged (%s); downloading again", target, problem)
                shutil.rmtree(target)
            # back to shared (the kernel drops the exclusive lock first: an evictor may slip in, and
            # then the folder is simply fetched below)
            fcntl.flock(fd, fcntl.LOCK_SH)
        if not target.is_dir():
            _fetch(layout, manifest, target, verify=verify)
        if max_cache_bytes is not None:
            evict_least_recently_used(cache, max_bytes=max_cache_bytes, keep=target)
    return target


def adopt_into_cache(
    local_dir: str | os.PathLike[str],
    manifest: Manifest,
    *,
    cache_dir: str | os.PathLike[str],
    max_cache_bytes: int | None = None,
) -> Path:
    """Move the folder a checkpoint was just uploaded from into the local cache as that checkpoint
    (`<cache_dir>/<manifest digest>/`), so the next reader on this machine does not copy it back.

    `local_dir` must hold exactly the files the manifest lists (what `upload_checkpoint` uploaded);
    it must be on the cache's file system. A reader still checks the copy against the manifest.
    `max_cache_bytes` bounds the cache as a download does: older unpinned checkpoints go first.
    """
    source, cache = Path(local_dir), Path(cache_dir)
    target = cache / manifest.sha256
    problem = _local_copy_problem(source, manifest, verify=False)
    if problem is not None:
        raise ValueError(f"{source} is not the upload of {manifest.path}: {problem}")
    cache.mkdir(parents=True, exist_ok=True)
    with _pin(cache, manifest.sha256):
        if not target.is_dir():
            try:
                os.rename(source, target)
            except OSError:  # a reader downloaded it meanwhile
                if not target.is_dir():
                    raise
            else:  # the upload hashed these very files as it read them
                for entry in manifest.data["files"]:
                    _remember_sha256(target / entry["name"], entry["sha256"])
        if max_cache_bytes is not None:
            evict_least_recently_used(cache, max_bytes=max_cache_bytes, keep=target)
    return target


# -- eviction --------------------------------------------------------------------------------
def _folder_bytes(folder: Path) -> int:
    """Bytes under `folder`; files another evictor removes meanwhile count as gone."""
    total = 0
    for parent, _, files in os.walk(folder):  # os.walk skips folders that vanish under it
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(parent, name)).st_size
    return total


def _mtime(folder: Path) -> float | None:
    try:
        return folder.stat().st_mtime
    except FileNotFoundError:
        return None


def _drop_orphan_pins(cache_dir: Path) -> None:
    """Remove pin files of checkpoints no longer cached (a download that failed) nobody holds."""
    pins = cache_dir / PINS
    for path in list(pins.iterdir()) if pins.is_dir() else []:
        if (cache_dir / path.name).is_dir() or (fd := _lock(path, fcntl.LOCK_EX | fcntl.LOCK_NB)) is None:
            continue
        try:
            if not (cache_dir / path.name).is_dir():
                os.unlink(path)
        finally:
            os.close(fd)


def evict_least_recently_used(cache_dir: Path, *, max_bytes: int, keep: Path | None = None) -> list[Path]:
    """Remove cached checkpoints (`<cache_dir>/<64 hex digits>/`), least recently used first, until
    they hold at most `max_bytes`; `keep` and every pinned checkpoint stay (the cache may then stay
    over the bound until their readers finish). Returns the removed folders."""
    used = {p: t for p in cache_dir.iterdir() if len(p.name) == 64 and p.is_dir() and (t := _mtime(p)) is not None}
    sizes = {p: _folder_bytes(p) for p in used}
    total = sum(sizes.values())
    removed, busy = [], 0
    _drop_orphan_pins(cache_dir)
    for folder in sorted(used, key=used.__getitem__):
        if total <= max_bytes:
            break
        if folder == keep:
            continue
        fd = _lock(_pin_path(cache_dir, folder.name), fcntl.LOCK_EX | fcntl.LOCK_NB)
        if fd is None:
            busy += 1
            continue
        try:
            if folder.is_dir():  # another evictor may have removed it since the listing
                shutil.rmtree(folder)
                removed.append(folder)
            total -= sizes[folder]
            os.unlink(_pin_path(cache_dir, folder.name))
        finally:
            os.close(fd)
    if removed or busy:
        logger.info(
            "cache %s: evicted %d checkpoint(s) to stay under %d bytes; %d in use kept",
            cache_dir,
            len(removed),
            max_bytes,
            busy,
        )
    return removed


def download_checkpoint_files(
    layout: RunLayout,
    ref: str | int | Manifest,
    kind: str = "policy",
    *,
    include: Callable[[str], bool],
    cache_dir: str | os.PathLike[str],
    verify: bool = True,
) -> Path:
    """Local folder holding only the files of checkpoint `ref` whose names pass `include`; `ref` may
    be the checkpoint's manifest, already read (then `kind` is not used).

    For readers that need part of a checkpoint (a tokenizer without the weights). The folder is
    named by its content, `<cache_dir>/files-<digest of the chosen names and their sha256>/`, so
    the checkpoints of a run that carry the same files (every policy carries the base model's
    tokenizer files) share one folder however many iterations are read. It is reused when its
    files match the manifest (sha256 when `verify`); fails when `include` keeps no file. Eviction
    never touches it: there is one per distinct set of files.
    """
    manifest = ref if isinstance(ref, Manifest) else resolve_checkpoint(layout, ref, kind)
    entries = [e for e in manifest.data["files"] if include(e["name"])]
    if not entries:
        names = [e["name"] for e in manifest.data["files"]][:8]
        raise FileNotFoundError(f"checkpoint {manifest.path} has no file that `include` keeps; files: {names}")
    content = "".join(f"{e['name']}\0{e['sha256']}\n" for e in sorted(entries, key=lambda e: e["name"]))
    target = Path(cache_dir) / f"{PARTIAL_PREFIX}{hashlib.sha256(content.encode()).hexdigest()}"
    for entry in entries:
        local = target / entry["name"]
        fresh = local.is_file() and local.stat().st_size == entry["bytes"]
        if fresh and (not verify or sha256_local_file(local) == entry["sha256"]):
            continue
        url = layout.url(entry["path"])
        partial = local.with_name(f".{local.name}.tmp{owner_tag()}")
        copied = layout.store.get_to_local(url, partial)
        if verify and (actual := copied or sha256_local_file(partial)) != entry["sha256"]:
            partial.unlink()
            raise ChecksumMismatchError(url, expected=entry["sha256"], actual=actual)
        os.replace(partial, local)
    return target
