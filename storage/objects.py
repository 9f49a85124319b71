"""Object operations with the guarantees the run layout relies on, per backend.

| operation            | file://                          | s3://                               | memory://           |
|----------------------|----------------------------------|-------------------------------------|---------------------|
| `write_bytes`        | tmp + fsync + rename (atomic)    | one PUT (atomic)                    | under a process lock|
| `create_exclusive`   | tmp + `link()` (atomic, O_EXCL)  | PUT `If-None-Match: *`              | under a process lock|
| `replace_if_tag`     | compare under `flock` + rename   | PUT `If-Match: <etag>`              | under a process lock|
| `delete_if_tag`      | compare under `flock` + unlink   | DELETE `If-Match: <etag>`           | under a process lock|

Every remote operation goes through `call_with_retry`. Paths handed in are URLs (see `storage.urls`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from storage.errors import PreconditionFailedError, StorageIOError
from storage.hashing import check_known, copy_hashing, sha256_bytes, sha256_local_file
from storage.retry import RetryPolicy, call_with_retry
from storage.scratch import tmp_sibling
from storage.urls import Backend, protocol, resolve

logger = logging.getLogger(__name__)

_MEMORY_LOCK = threading.RLock()  # memory:// is one dict per process: one lock makes its writes exclusive


@contextmanager
def _removed_on_failure(tmp: str) -> Iterator[None]:
    """Remove the temporary file `tmp` when the block fails (it may not exist yet), then re-raise."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


# os.link's refusals that mean "copy instead": another file system, or one without hard links
_NO_LINK = (errno.EXDEV, errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK)


def _link(source: str | os.PathLike[str], target: str) -> bool:
    """Hard-link `source` at `target` (a new name); False where the file system refuses the link."""
    try:
        os.link(source, target)
    except OSError as exc:
        if exc.errno in _NO_LINK:
            return False
        raise
    return True


def _is_precondition_failed(exc: BaseException) -> bool:
    import botocore.exceptions

    current: BaseException | None = exc
    while current is not None:
        if isinstance(current, botocore.exceptions.ClientError):
            error = current.response.get("Error", {})
            status = current.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            return bool(error.get("Code") == "PreconditionFailed" or status == 412)
        current = current.__cause__ or current.__context__
    return False


class ObjectStore:
    """One filesystem plus the conditional operations a run needs; built by `RunLayout`."""

    def __init__(self, url: str, *, storage_options: Mapping[str, Any] | None, retry: RetryPolicy) -> None:
        self.fs: AbstractFileSystem
        self.fs, _ = resolve(url, storage_options)
        self.backend: Backend = protocol(url)
        self.retry = retry
        expected = {"file": LocalFileSystem, "memory": MemoryFileSystem}.get(self.backend)
        if expected is not None and not isinstance(self.fs, expected):
            raise TypeError(f"{url!r} resolved to {type(self.fs).__name__}, expected {expected.__name__}")

    def __repr__(self) -> str:  # never show storage options (they may hold credentials)
        return f"ObjectStore(backend={self.backend!r})"

    # -- plumbing ---------------------------------------------------------------------------
    def path(self, url: str) -> str:
        """The filesystem path of a URL."""
        path: str = self.fs._strip_protocol(url)
        return path

    def _call(self, fn: Any, what: str, url: str) -> Any:
        """Run one operation on `url`; OS errors (a full disk, a permission) come back naming it.

        FileNotFoundError and FileExistsError pass unchanged: callers act on them.
        """
        try:
            if self.backend == "s3":
                return call_with_retry(fn, policy=self.retry, what=f"{what} {url}")
            return fn()
        except (FileNotFoundError, FileExistsError):
            raise
        except StorageIOError:
            raise
        except OSError as exc:
            raise StorageIOError(url, what, exc) from exc

    def _ensure_parent(self, path: str) -> None:
        if self.backend == "file":
            os.makedirs(os.path.dirname(path), exist_ok=True)

    @contextmanager
    def _local_dir_lock(self, path: str) -> Iterator[None]:
        """flock on the parent directory: serialises compare-and-swap between processes of one host."""
        fd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _local_write_tmp(self, path: str, data: bytes) -> str:
        """`data` in a synced temporary file beside `path`; nothing is left when the write fails."""
        self._ensure_parent(path)
        tmp = tmp_sibling(path)
        with _removed_on_failure(tmp), open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    # -- reads ------------------------------------------------------------------------------
    def exists(self, url: str) -> bool:
        path = self.path(url)
        return bool(self._call(lambda: self.fs.exists(path), "exists", url))

    def read_bytes(self, url: str) -> bytes:
        path = self.path(url)
        data: bytes = self._call(lambda: self.fs.cat_file(path), "read", url)
        return data

    def size(self, url: str) -> int:
        path = self.path(url)
        return int(self._call(lambda: self.fs.size(path), "size", url))

    def list_files(self, url: str) -> list[str]:
        """URLs of all files under `url` (recursive), sorted; empty when nothing is there."""
        return list(self.list_file_sizes(url))

    def list_file_sizes(self, url: str) -> dict[str, int]:
        """{URL: bytes} of all files under `url` (recursive) from one listing; empty when nothing is there."""
        path = self.path(url)

        def find() -> dict[str, Any]:
            if not self.fs.exists(path):
                return {}
            found: dict[str, Any] = self.fs.find(path, detail=True)
            return found

        found = self._call(find, "list", url)
        return {self._url_of(p): int(info["size"]) for p, info in sorted(found.items())}

    def list_dirs(self, url: str) -> list[str]:
        """Names of the immediate sub-directories (prefixes) of `url`."""
        path = self.path(url)

        def ls() -> list[str]:
            if not self.fs.exists(path):
                return []
            return [e["name"] for e in self.fs.ls(path, detail=True) if e["type"] == "directory"]

        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self._call(ls, "ls", url))

    def _url_of(self, path: str) -> str:
        if self.backend == "file":
            return "file://" + path
        if self.backend == "memory":
            return "memory://" + path
        return "s3://" + path

    def open_read(self, url: str) -> IO[bytes]:
        handle: IO[bytes] = self.fs.open(self.path(url), "rb")
        return handle

    def read_tagged(self, url: str) -> tuple[bytes, str]:
        """(content, tag) where the tag identifies this exact content for `replace_if_tag`.

        On s3 the ETag is fetched BEFORE the body: if the object changes in between, the tag is stale
        and the conditional write fails, which is the safe direction.
        """
        if self.backend == "s3":
            path = self.path(url)
            etag = self._call(lambda: self.fs.info(path)["ETag"], "head", url)
            return self.read_bytes(url), str(etag)
        data = self.read_bytes(url)
        return data, sha256_bytes(data)

    # -- writes -----------------------------------------------------------------------------
    def write_bytes(self, url: str, data: bytes) -> None:
        """Atomic create-or-replace: readers see the old or the new content, never a mix."""
        path = self.path(url)
        if self.backend == "file":
            self._call(lambda: os.replace(self._local_write_tmp(path, data), path), "write", url)
            return
        if self.backend == "memory":
            with _MEMORY_LOCK:
                self.fs.pipe_file(path, data)
            return
        self._call(lambda: self.fs.pipe_file(path, data), "put", url)

    def create_exclusive(self, url: str, data: bytes) -> None:
        """Create `url` with `data`; raise FileExistsError if it already exists (atomic on every backend)."""
        path = self.path(url)
        if self.backend == "file":

            def link() -> None:
                tmp = self._local_write_tmp(path, data)
                try:
                    os.link(tmp, path)
                finally:
                    os.unlink(tmp)

            self._call(link, "create", url)
            return
        if self.backend == "memory":
            with _MEMORY_LOCK:
                if self.fs.exists(path):
                    raise FileExistsError(f"{url} already exists")
                self.fs.pipe_file(path, data)
            return
        attempts = 0

        def put() -> None:
            nonlocal attempts
            attempts += 1
            try:
                self.fs.pipe_file(path, data, mode="create")
            except FileExistsError:
                # A retried PUT can find the object its own lost-response attempt created.
                if attempts > 1 and self.fs.cat_file(path) == data:
                    return
                raise

        call_with_retry(put, policy=self.retry, what=f"conditional put {url}")

    def replace_if_tag(self, url: str, data: bytes, tag: str) -> None:
        """Replace `url` only if it still holds the content `tag` was read from; else PreconditionFailedError."""
        path = self.path(url)
        if self.backend == "s3":
            bucket, key, _ = self.fs.split_path(path)
            self._s3_conditional("put_object", url, Bucket=bucket, Key=key, Body=data, IfMatch=tag)
            return
        with self._exclusive_local_or_memory(path):
            if not self.fs.exists(path) or sha256_bytes(self.fs.cat_file(path)) != tag:
                raise PreconditionFailedError(f"{url} changed since it was read")
            if self.backend == "file":
                self._call(lambda: os.replace(self._local_write_tmp(path, data), path), "write", url)
            else:
                self.fs.pipe_file(path, data)

    def delete_if_tag(self, url: str, tag: str) -> None:
        """Delete `url` only if it still holds the content `tag` was read from; else PreconditionFailedError."""
        path = self.path(url)
        if self.backend == "s3":
            bucket, key, _ = self.fs.split_path(path)
            self._s3_conditional("delete_object", url, Bucket=bucket, Key=key, IfMatch=tag)
            return
        with self._exclusive_local_or_memory(path):
            if not self.fs.exists(path) or sha256_bytes(self.fs.cat_file(path)) != tag:
                raise PreconditionFailedError(f"{url} changed since it was read")
            self.fs.rm_file(path)

    @contextmanager
    def _exclusive_local_or_memory(self, path: str) -> Iterator[None]:
        if self.backend == "file":
            with self._local_dir_lock(path):
                yield
        else:
            with _MEMORY_LOCK:
                yield

    def _s3_conditional(self, method: str, url: str, **kwargs: Any) -> None:
        def call() -> None:
            try:
                self.fs.call_s3(method, **kwargs)
            except OSError as exc:
                if _is_precondition_failed(exc):
                    raise PreconditionFailedError(f"{url} changed since it was read") from exc
                raise

        call_with_retry(call, policy=self.retry, what=f"conditional {method} {url}")

    def put_local_file(
        self, local_path: str | os.PathLike[str], url: str, *, link: bool = False, sha256: str | None = None
    ) -> str:
        """Upload (or copy) one local file to `url`, whole-file retried on s3; returns its sha256.

        On file:// the file is written beside `url` and renamed onto it, so a file already there is
        replaced, never written into. The digest is taken from the bytes as they are copied (one
        read of the file). With `link`, a file:// store on the file's own file system takes it as a
        hard link instead of a copy, and the digest is read from it: for a file its writer hands
        over, which nothing writes again (a stage's output in its scratch folder), since the
        store's file and `local_path` are then one file. The caller's own files (a user's model
        folder) are copied: rewriting one in place would change the stored bytes.

        `sha256`: the digest the file's writer took from the bytes it wrote
        (`write_local_hashing`). A linked file or an s3 upload is then not read again; a copy,
        which reads the bytes anyway, must match it."""
        path = self.path(url)
        if self.backend == "file":
            self._ensure_parent(path)
            tmp = tmp_sibling(path)

            def put() -> str:
                with _removed_on_failure(tmp):
                    if link and _link(local_path, tmp):
                        digest = sha256 or sha256_local_file(tmp)
                    else:
                        digest = copy_hashing(local_path, tmp)
                        check_known(local_path, digest, sha256)
                    os.replace(tmp, path)
                return digest

            return str(self._call(put, "link" if link else "copy", url))
        if self.backend == "memory":
            data = Path(local_path).read_bytes()
            digest = sha256_bytes(data)
            check_known(local_path, digest, sha256)
            self.fs.pipe_file(path, data)
            return digest
        self._call(lambda: self.fs.put_file(os.fspath(local_path), path), "upload", url)
        return sha256 or sha256_local_file(local_path)

    def get_to_local(self, url: str, local_path: str | os.PathLike[str]) -> str | None:
        """Download (or copy) `url` to a local file, whole-file retried on s3. Returns the sha256 of
        the bytes on file:// (taken as they are copied), None where it was not computed on the way."""
        path = self.path(url)
        os.makedirs(os.path.dirname(os.fspath(local_path)), exist_ok=True)
        if self.backend == "file":
            return str(self._call(lambda: copy_hashing(path, local_path), "copy", url))
        self._call(lambda: self.fs.get_file(path, os.fspath(local_path)), "download", url)
        return None

    def open_write(self, url: str) -> IO[bytes]:
        """A streaming writer for file:// and memory:// (s3 writes are spooled and uploaded whole)."""
        if self.backend == "s3":
            raise ValueError(f"open_write is not used on s3 (spool locally, then put_local_file): {url}")
        path = self.path(url)
        self._ensure_parent(path)
        handle: IO[bytes] = self.fs.open(path, "wb")
        return handle

    def remove_file(self, url: str) -> None:
        """Remove one object; nothing there is fine."""
        path = self.path(url)

        def rm() -> None:
            if self.fs.exists(path):
                self.fs.rm_file(path)

        self._call(rm, "remove", url)

    def remove_tree(self, url: str) -> None:
        """Remove everything under `url`; nothing there is fine."""
        path = self.path(url)
        if self.backend == "file":
            self._call(lambda: shutil.rmtree(path) if os.path.isdir(path) else None, "remove", url)
            return

        def rm() -> None:
            files = self.fs.find(path)
            if files:
                self.fs.rm(files)
            if self.backend == "memory" and self.fs.isdir(path):
                self.fs.rm(path, recursive=True)

        self._call(rm, "remove", url)
