"""Exceptions raised by `storage`: each names the object and the values that disagree."""

from __future__ import annotations


class StorageError(Exception):
    """Base class for every failure `storage` raises on purpose."""


class AlreadyCommittedError(StorageError):
    """A committed output (manifest present) would be overwritten."""


class NotCommittedError(StorageError):
    """An output is read but has no manifest, so it does not exist."""


class ChecksumMismatchError(StorageError):
    """A file's sha256 differs from the digest its manifest recorded. `needed_by` names the file
    whose rows it was read to join, if any."""

    def __init__(self, url: str, *, expected: str, actual: str, needed_by: str | None = None) -> None:
        joined = f" (read to join the rows of {needed_by})" if needed_by else ""
        super().__init__(f"sha256 mismatch for {url}{joined}: manifest says {expected}, file has {actual}")
        self.url = url
        self.needed_by = needed_by
        self.expected = expected
        self.actual = actual


class SchemaVersionError(StorageError):
    """A shard was written with another schema (name or version) than this code reads."""


class ShardJoinError(StorageError):
    """A shard and the rows of the stage it extends do not line up (row counts or sample ids); the
    message names both files."""


class ShardInvariantError(StorageError):
    """Rows handed to a shard writer break a documented column invariant."""


class ConfigMismatchError(StorageError):
    """A run is opened with a config that differs from the one it was created with."""


class LockHeldError(StorageError):
    """Another writer holds the run lock."""


class PreconditionFailedError(StorageError):
    """A conditional replace or delete found the object changed since it was read."""


class StorageIOError(StorageError, OSError):
    """An operating-system error (no space left, permission denied, ...) on a named URL.

    It is an `OSError` with the original errno, so callers that handle OS errors still do.
    """

    def __init__(self, url: str, what: str, exc: OSError) -> None:
        reason = exc.strerror or str(exc)
        super().__init__(exc.errno, f"{what} {url}: {reason}")
        self.url = url


class CorruptManifestError(StorageError):
    """A manifest (or LATEST, run.json, summary.json) that is not the UTF-8 JSON object this code writes."""


class DamagedOutputError(StorageError):
    """Something committed that a run would reuse (a shard, a manifest, LATEST) no longer matches the
    digest recorded for it. `url` names the file; the message says what to do."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(message)
        self.url = url
