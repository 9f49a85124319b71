"""Manifests: an output exists only once its manifest does, and a manifest is never overwritten.

A manifest is a JSON object written LAST with an exclusive create (`ObjectStore.create_exclusive`).
Its sha256 (of the stored bytes) is its identity: children name their parents by path and digest.
Committing an iteration writes the iteration manifest, then replaces `LATEST`.

A manifest also records, when it is written, the digest of its own content (`content_sha256`: the
sha256 of the manifest's canonical JSON without that field and the signature), and every read
checks it. So a manifest that nothing names yet (the last committed stage of an iteration not yet
committed) is refused once changed by accident, valid JSON or not. Manifests of version 1 predate
the field; only runs created before it (`run.json`'s layout version 1) may hold them.

Against a deliberate edit, which recomputes the digests, every read also checks the anchors of
`storage.anchor`: the digest the tracking record holds for the manifest, and, with a signing key in
the environment, the manifest's signature.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from storage import anchor
from storage.errors import AlreadyCommittedError, ChecksumMismatchError, CorruptManifestError, NotCommittedError
from storage.faults import crash_point
from storage.hashing import sha256_bytes
from storage.layout import LAYOUT_VERSION, RunLayout, read_run
from storage.provenance import code_version, utc_now

logger = logging.getLogger(__name__)

MANIFEST_VERSION = 2
CONTENT_DIGEST = "content_sha256"
ITERATION_STAGES = ("rollout", "teacher", "train")


@dataclass(frozen=True)
class Manifest(Mapping[str, Any]):
    """A manifest as read from (or written to) the store: its run-relative path, digest and content.

    It reads like its content (`manifest["metrics"]`); `ref` is how children name it.
    """

    path: str
    sha256: str
    data: dict[str, Any]

    @property
    def ref(self) -> dict[str, str]:
        """How a child manifest names this one."""
        return {"path": self.path, "sha256": self.sha256}

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)


def plain_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """JSON-ready metrics: numpy scalars unwrapped; NaN/inf refused (a manifest must be valid JSON)."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"metric {key!r} is {value}; manifests hold finite numbers only")
        if value is not None and not isinstance(value, str | int | float | bool):
            raise TypeError(f"metric {key!r} has type {type(value).__name__}; use numbers or strings")
        out[key] = value
    return out


WALL_CLOCK_METRICS = ("seconds", "per_second")


def is_wall_clock(metric: str) -> bool:
    """Whether a metric measures time taken (`.../seconds`, `..._per_second`): it differs between
    any two runs, and is kept out of the files whose bytes two runs of one config share."""
    return metric.endswith(WALL_CLOCK_METRICS)


def _encode(data: Mapping[str, Any]) -> bytes:
    return (json.dumps(data, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()


def content_digest(data: Mapping[str, Any]) -> str:
    """The digest a manifest records of its own content: its canonical JSON without that field and
    without its signature."""
    return sha256_bytes(_encode({k: v for k, v in data.items() if k not in (CONTENT_DIGEST, anchor.SIGNATURE)}))


def write_manifest(layout: RunLayout, url: str, data: Mapping[str, Any]) -> Manifest:
    """Create the manifest at `url`, with the digest of its content (and its signature, with a signing
    key in the environment); AlreadyCommittedError if one exists (never overwritten)."""
    digest = content_digest(data)
    signed = {}
    if (key := anchor.signing_key()) is not None:
        path = layout.relative(url)
        signed = {anchor.SIGNATURE: anchor.sign(key, run=layout.run_name, path=path, content_sha256=digest)}
    payload = _encode({**data, **signed, CONTENT_DIGEST: digest})
    try:
        layout.store.create_exclusive(url, payload)
    except FileExistsError as exc:
        raise AlreadyCommittedError(f"{url} already exists: committed outputs are never overwritten") from exc
    return Manifest(path=layout.relative(url), sha256=sha256_bytes(payload), data=json.loads(payload))


def read_manifest(layout: RunLayout, url: str) -> Manifest:
    """The manifest at `url`, checked (`check_content`, `check_anchors`); NotCommittedError when
    there is none."""
    if not layout.store.exists(url):
        raise NotCommittedError(f"no manifest at {url}: the output is not committed")
    payload = layout.store.read_bytes(url)
    data = decode_json_object(url, payload)
    check_content(url, data, legacy=lambda: _created_before_content_digests(layout))
    manifest = Manifest(path=layout.relative(url), sha256=sha256_bytes(payload), data=data)
    check_anchors(layout, manifest)
    return manifest


def _created_before_content_digests(layout: RunLayout) -> bool:
    """Whether the run was created before every manifest recorded its content digest (run.json's
    layout version 1): only such a run may hold version-1 manifests."""
    return int(read_run(layout).get("layout_version", 1)) < LAYOUT_VERSION


def check_anchors(layout: RunLayout, manifest: Manifest) -> None:
    """Refuse a manifest that differs from what its anchors say (CorruptManifestError naming it): the
    digest the run's tracking record holds for it, when this process registered one
    (`storage.anchor`), and, with a signing key in the environment, its signature."""
    url = layout.url(manifest.path)
    recorded = anchor.recorded_digest(layout.run_url, manifest.path)
    if recorded is not None and recorded != manifest.sha256:
        raise CorruptManifestError(
            f"{url} has sha256 {manifest.sha256}, but the run's tracking record holds {recorded}, recorded when it "
            "was committed: it was changed since"
        )
    key = anchor.signing_key()
    if key is None:
        return
    signature = manifest.data.get(anchor.SIGNATURE)
    digest = content_digest(manifest.data)
    if not isinstance(signature, str):
        raise CorruptManifestError(
            f"{url} is not signed, and {anchor.SIGNING_KEY_ENV} is set: every manifest of a run written with the "
            "key carries a signature (a run started without the key is checked without it: unset it)"
        )
    expected = anchor.sign(key, run=layout.run_name, path=manifest.path, content_sha256=digest)
    if not hmac.compare_digest(signature, expected):
        raise CorruptManifestError(
            f"{url}: its signature does not match its content under {anchor.SIGNING_KEY_ENV}: it was edited, moved "
            "from another place, or signed with another key"
        )


def check_content(url: str, data: Mapping[str, Any], *, legacy: Callable[[], bool] = lambda: False) -> None:
    """Refuse a manifest whose content is not what it recorded when written (CorruptManifestError
    naming `url`). A version-1 manifest, written before manifests recorded their content, passes only
    in a run that `legacy()` says was created then."""
    if data.get("manifest_version") == 1 and CONTENT_DIGEST not in data and legacy():
        return
    recorded = data.get(CONTENT_DIGEST)
    if not isinstance(recorded, str):
        raise CorruptManifestError(
            f"{url} has no {CONTENT_DIGEST} (every manifest records one since manifest version 2, and a run "
            "created since holds no other): it was not written by this pipeline or was edited"
        )
    if (actual := content_digest(data)) != recorded:
        raise CorruptManifestError(
            f"{url} was changed after it was written: its content has sha256 {actual}, it recorded {recorded}"
        )


def decode_json_object(url: str, payload: bytes) -> dict[str, Any]:
    """The JSON object stored at `url`; CorruptManifestError naming the URL when it is not one."""
    try:
        data = json.loads(payload.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CorruptManifestError(
            f"{url} is not UTF-8 (byte {exc.start}: {payload[exc.start : exc.start + 1]!r})"
        ) from exc
    except json.JSONDecodeError as exc:
        raise CorruptManifestError(
            f"{url} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from exc
    if not isinstance(data, dict):
        raise CorruptManifestError(f"{url} holds a JSON {type(data).__name__}, expected an object")
    return data


def verify_ref(layout: RunLayout, ref: Mapping[str, str]) -> Manifest:
    """Read the manifest a child names and check it still has the digest the child recorded."""
    manifest = read_manifest(layout, layout.url(ref["path"]))
    if manifest.sha256 != ref["sha256"]:
        raise ChecksumMismatchError(layout.url(ref["path"]), expected=ref["sha256"], actual=manifest.sha256)
    return manifest


def base_fields(layout: RunLayout, kind: str) -> dict[str, Any]:
    """Fields every manifest carries."""
    return {
        "kind": kind,
        "manifest_version": MANIFEST_VERSION,
        "run": layout.run_name,
        "config_hash": read_run(layout)["config_hash"],
        "code_version": code_version(),
        "created_at": utc_now(),
    }


# -- stages ---------------------------------------------------------------------------------
def stage_done(layout: RunLayout, n: int, stage: str) -> bool:
    return layout.store.exists(layout.stage_manifest(n, stage))


def read_stage_manifest(layout: RunLayout, n: int, stage: str) -> Manifest:
    return read_manifest(layout, layout.stage_manifest(n, stage))


# -- iterations -----------------------------------------------------------------------------
def read_latest_pointer(layout: RunLayout) -> dict[str, Any] | None:
    """LATEST as stored ({iteration, manifest, sha256, updated_at}), or None when nothing is committed."""
    if not layout.store.exists(layout.latest):
        return None
    pointer = decode_json_object(layout.latest, layout.store.read_bytes(layout.latest))
    if not isinstance(pointer.get("iteration"), int) or isinstance(pointer["iteration"], bool):
        raise CorruptManifestError(
            f"{layout.latest}: field 'iteration' is {pointer.get('iteration')!r}, expected an int"
        )
    return pointer


def read_latest(layout: RunLayout) -> int | None:
    """The last committed iteration, or None when none is."""
    pointer = read_latest_pointer(layout)
    return None if pointer is None else int(pointer["iteration"])


def verify_latest(layout: RunLayout) -> int | None:
    """The LATEST iteration after checking that LATEST names its iteration manifest by path and digest."""
    pointer = read_latest_pointer(layout)
    if pointer is None:
        return None
    n = int(pointer["iteration"])
    expected = layout.relative(layout.iteration_manifest(n))
    if pointer.get("manifest") != expected:
        raise CorruptManifestError(f"{layout.latest} names {pointer.get('manifest')!r}, expected {expected!r}")
    verify_ref(layout, {"path": expected, "sha256": str(pointer.get("sha256"))})
    return n


def iteration_committed(layout: RunLayout, n: int) -> bool:
    return layout.store.exists(layout.iteration_manifest(n))


def read_iteration_manifest(layout: RunLayout, n: int) -> Manifest:
    return read_manifest(layout, layout.iteration_manifest(n))


def _move_latest(layout: RunLayout, manifest: Manifest, n: int) -> None:
    pointer = {"iteration": n, "manifest": manifest.path, "sha256": manifest.sha256, "updated_at": utc_now()}
    layout.store.write_bytes(layout.latest, _encode(pointer))
    logger.info("run %s: LATEST -> iteration %d (%s)", layout.run_name, n, manifest.sha256[:12])


def commit_iteration(
    layout: RunLayout,
    n: int,
    *,
    metrics: Mapping[str, Any],
    stages: Sequence[str] = ITERATION_STAGES,
    checkpoints: Sequence[str] = ("policy",),
    timings: Mapping[str, float] | None = None,
) -> Manifest:
    """Write iteration n's manifest (naming its stage and checkpoint manifests by digest), then LATEST.

    Iterations commit in order: LATEST must be n-1, or absent for the run's first commit (whatever
    its number). Idempotent: a committed iteration returns its manifest, and if a previous commit
    wrote the manifest but died before LATEST moved, this finishes it.
    """
    latest = read_latest(layout)
    if iteration_committed(layout, n):
        existing = read_iteration_manifest(layout, n)
        if latest == n:
            return existing
        latest_when_written = None if existing.data["previous"] is None else n - 1
        if latest == latest_when_written:
            logger.warning("iteration %d was committed but LATEST not moved; finishing the commit", n)
            crash_point("commit.manifest_written", n)
            _move_latest(layout, existing, n)
            crash_point("commit.latest_moved", n)
            return existing
        raise AlreadyCommittedError(
            f"iteration {n} of run {layout.run_name!r} is committed but LATEST is {latest}: iterations commit in order"
        )
    if latest is not None and latest != n - 1:
        raise ValueError(f"cannot commit iteration {n} of run {layout.run_name!r}: LATEST is {latest}, need {n - 1}")
    crash_point("commit.start", n)
    stage_refs = {stage: read_stage_manifest(layout, n, stage).ref for stage in stages}
    checkpoint_refs = {kind: read_manifest(layout, layout.checkpoint_manifest(n, kind)).ref for kind in checkpoints}
    previous = None if latest is None else read_iteration_manifest(layout, latest).ref
    data = {
        **base_fields(layout, "iteration"),
        "iteration": n,
        "stages": stage_refs,
        "checkpoints": checkpoint_refs,
        "previous": previous,
        "metrics": plain_metrics(metrics),
        "timings": plain_metrics(timings or {}),
    }
    manifest = write_manifest(layout, layout.iteration_manifest(n), data)
    crash_point("commit.manifest_written", n)
    _move_latest(layout, manifest, n)
    crash_point("commit.latest_moved", n)
    return manifest
