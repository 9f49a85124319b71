"""The audit trail's anchors outside the store: digests recorded when each output was committed, and
a signing key.

Every manifest records the digest of its content and children name their parents by digest, up to
`LATEST` (`storage.manifest`); but the whole chain lives in the store, so whoever can write the store
can edit a manifest and recompute every digest that covers it. Two anchors that such an edit cannot
pass, either or both:

- **Recorded digests**: the sha256 of each manifest (run-relative path -> digest), recorded in the run's
  tracking record (its MLflow run: `tasks/tracking/anchor.py`) when the output is committed. The runs
  this process works on are registered here (`register`, `remember`), and every manifest read checks
  its digest against them (`storage.manifest.read_manifest`): one that differs is refused, named.
- **Signatures**: with a key in the environment (`SDPO_SIGNING_KEY`), every manifest written carries an
  HMAC-SHA256 over the run, its path and its content digest, and every manifest read must carry a
  valid one. For a store whose tracking database sits beside it (the default SQLite store of a local
  root), where one write access reaches both, and for runs with tracking off.

The key is never written anywhere; a process without it checks no signature.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping

__all__ = [
    "SIGNATURE",
    "SIGNING_KEY_ENV",
    "forget",
    "recorded",
    "recorded_digest",
    "register",
    "remember",
    "sign",
    "signing_key",
    "unrecord",
]

SIGNING_KEY_ENV = "SDPO_SIGNING_KEY"
SIGNATURE = "signature"  # the manifest field holding the HMAC

_RECORDED: dict[str, dict[str, str]] = {}  # run URL -> {run-relative manifest path: sha256}


def register(run_url: str, digests: Mapping[str, str]) -> None:
    """The digests the tracking record holds for the run at `run_url`: from now on, until this process
    lets go of the run's lock (`storage.lock.RunLock.release`), every manifest of the run it reads is
    checked against them."""
    _RECORDED[run_url] = dict(digests)


def remember(run_url: str, path: str, sha256: str) -> None:
    """One more digest recorded for the run (a stage or commit that just ended)."""
    _RECORDED.setdefault(run_url, {})[path] = sha256


def recorded(run_url: str) -> dict[str, str] | None:
    """The digests registered for the run, or None when it has no recorded anchor in this process."""
    found = _RECORDED.get(run_url)
    return None if found is None else dict(found)


def recorded_digest(run_url: str, path: str) -> str | None:
    """The digest recorded for the manifest at run-relative `path`, or None."""
    return _RECORDED.get(run_url, {}).get(path)


def unrecord(run_url: str, path: str) -> None:
    """Forget one digest: the manifest is absent and about to be computed again."""
    _RECORDED.get(run_url, {}).pop(path, None)


def forget(run_url: str) -> None:
    _RECORDED.pop(run_url, None)


def signing_key() -> bytes | None:
    """The signing key from the environment (SDPO_SIGNING_KEY), or None when it is not set."""
    key = os.environ.get(SIGNING_KEY_ENV, "")
    return key.encode() if key else None


def sign(key: bytes, *, run: str, path: str, content_sha256: str) -> str:
    """The HMAC-SHA256 of a manifest: its run, its run-relative path and the digest of its content, so
    that a signed manifest cannot be moved to another run or place, nor its content changed."""
    message = f"sdpo-manifest\n{run}\n{path}\n{content_sha256}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()
