"""`sdpo verify`: re-read everything a run has committed and check it against its manifests.

Checked, from the top down:
- `run.json`: its `config_hash` is the hash of its config; each accepted config change likewise;
- `LATEST`: names the iteration manifest of its iteration, with that manifest's digest;
- every iteration manifest: the stage, checkpoint and previous-iteration manifests it names still
  have the digests it recorded;
- every stage and checkpoint manifest: each file it lists exists, has its size and its sha256 (the
  store's copy is hashed, never a cached one); the parent and training-data manifests it names
  still have their recorded digests.
A manifest that is not valid JSON is a problem too. Files without a manifest are leftovers of an
interrupted attempt (never read: they do not exist for the pipeline) and are counted, not failed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from storage.errors import StorageError
from storage.hashing import sha256_bytes
from storage.layout import CHECKPOINT_KINDS, MANIFEST_NAME, STAGES, RunLayout, read_config_changes
from storage.manifest import Manifest, read_latest_pointer, read_manifest

_CHUNK = 8 * 2**20


@dataclass
class Report:
    """What `verify_run` found: problems (url, what is wrong), counts of what was checked."""

    problems: list[tuple[str, str]] = field(default_factory=list)
    manifests: int = 0
    files: int = 0
    bytes: int = 0
    uncommitted: list[str] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def bad(self, url: str, what: str) -> None:
        self.problems.append((url, what))


def stored_sha256(layout: RunLayout, url: str) -> str:
    """sha256 of the store's copy of `url`, read in chunks (never a cached copy)."""
    digest = hashlib.sha256()
    with layout.store.open_read(url) as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


_FIELDS: dict[str, dict[str, type]] = {
    "stage": {"files": list, "parents": list},
    "checkpoint": {"files": list, "trained_on": list},
    "iteration": {"stages": dict, "checkpoints": dict},
}


def _manifest(layout: RunLayout, url: str, report: Report) -> Manifest | None:
    """The manifest at `url` when it parses and has the fields its kind needs; else a problem."""
    try:
        manifest = read_manifest(layout, url)
    except StorageError as exc:
        report.bad(url, str(exc))
        return None
    manifest_kind = manifest.data.get("kind")
    fields = _FIELDS.get(manifest_kind) if isinstance(manifest_kind, str) else None
    if fields is None:
        report.bad(url, f"field 'kind' is {manifest_kind!r}, expected one of {sorted(_FIELDS)}")
        return None
    for name, kind in fields.items():
        if not isinstance(manifest.data.get(name), kind):
            report.bad(url, f"field {name!r} is missing or not a {kind.__name__}")
            return None
    entries = manifest.data.get("files", []) + manifest.data.get("parents", []) + manifest.data.get("trained_on", [])
    entries += list(manifest.data.get("stages", {}).values()) + list(manifest.data.get("checkpoints", {}).values())
    for entry in entries:
        need = ("path", "sha256", "bytes") if entry in manifest.data.get("files", []) else ("path", "sha256")
        if not isinstance(entry, dict) or any(k not in entry for k in need):
            report.bad(url, f"an entry lacks one of {need}: {str(entry)[:120]}")
            return None
    report.manifests += 1
    return manifest


def _check_ref(layout: RunLayout, ref: Mapping[str, str] | None, owner: str, report: Report, role: str) -> None:
    if ref is None or "external" in ref:
        return
    url = layout.url(ref["path"])
    if not layout.store.exists(url):
        report.bad(owner, f"{role} {ref['path']} is missing")
        return
    actual = sha256_bytes(layout.store.read_bytes(url))
    if actual != ref["sha256"]:
        report.bad(owner, f"{role} {ref['path']} has sha256 {actual[:12]}, recorded {ref['sha256'][:12]}")


def _check_files(layout: RunLayout, manifest: Manifest, report: Report, progress: Callable[[int], None]) -> None:
    owner = layout.url(manifest.path)
    for entry in manifest.data.get("files", []):
        url = layout.url(entry["path"])
        if not layout.store.exists(url):
            report.bad(url, f"listed in {manifest.path} but missing")
            continue
        size = layout.store.size(url)
        if size != entry["bytes"]:
            report.bad(url, f"{size} bytes, {manifest.path} says {entry['bytes']}")
            continue
        actual = stored_sha256(layout, url)
        report.files += 1
        report.bytes += size
        progress(size)
        if actual != entry["sha256"]:
            report.bad(url, f"sha256 {actual[:12]} differs from {entry['sha256'][:12]} in {manifest.path}")
    for ref in manifest.data.get("parents", []):
        _check_ref(layout, ref, owner, report, "parent")
    if manifest.data.get("kind") == "checkpoint":
        _check_ref(layout, manifest.data.get("parent"), owner, report, "parent checkpoint")
        for ref in manifest.data.get("trained_on", []):
            _check_ref(layout, ref, owner, report, "training data")


def _check_run_json(layout: RunLayout, report: Report) -> None:
    from storage.layout import config_hash
    from storage.manifest import decode_json_object

    try:
        record = decode_json_object(layout.run_json, layout.store.read_bytes(layout.run_json))
    except StorageError as exc:
        report.bad(layout.run_json, str(exc))
        return
    if config_hash(record.get("config", {})) != record.get("config_hash"):
        report.bad(layout.run_json, "config_hash is not the hash of the stored config")
    try:
        changes = read_config_changes(layout)
    except (ValueError, UnicodeDecodeError) as exc:
        report.bad(layout.config_changes, f"unreadable: {exc}")
        return
    for i, change in enumerate(changes, start=1):
        if config_hash(change["config"]) != change["config_hash"]:
            report.bad(layout.config_changes, f"change {i}: config_hash is not the hash of its config")


def _check_latest(layout: RunLayout, report: Report) -> None:
    try:
        pointer = read_latest_pointer(layout)
    except StorageError as exc:
        report.bad(layout.latest, str(exc))
        return
    if pointer is None:
        return
    n = pointer["iteration"]
    expected = layout.relative(layout.iteration_manifest(n))
    if pointer.get("manifest") != expected:
        report.bad(layout.latest, f"names {pointer.get('manifest')!r}, expected {expected!r}")
        return
    _check_ref(
        layout, {"path": expected, "sha256": str(pointer.get("sha256"))}, layout.latest, report, "iteration manifest"
    )


def verify_run(layout: RunLayout, *, progress: Callable[[int], None] = lambda _: None) -> Report:
    """Check everything run `layout` has committed (see the module doc); `progress(bytes)` per file."""
    report = Report()
    if not layout.store.exists(layout.run_json):
        report.bad(layout.run_json, f"run {layout.run_name!r} does not exist")
        return report
    _check_run_json(layout, report)
    _check_latest(layout, report)
    manifests: list[tuple[str, str | None]] = []  # (manifest URL, tombstone URL for checkpoints)
    for n in layout.iterations():
        if layout.store.exists(layout.iteration_manifest(n)):
            if (it := _manifest(layout, layout.iteration_manifest(n), report)) is not None:
                owner = layout.iteration_manifest(n)
                for stage, ref in it.data["stages"].items():
                    _check_ref(layout, ref, owner, report, f"stage {stage}")
                for kind, ref in it.data["checkpoints"].items():
                    _check_ref(layout, ref, owner, report, f"checkpoint {kind}")
                _check_ref(layout, it.data["previous"], owner, report, "previous iteration")
        manifests += [(layout.stage_manifest(n, s), None) for s in STAGES]
    for n in layout.checkpoint_iterations():
        manifests += [(layout.checkpoint_manifest(n, k), layout.checkpoint_tombstone(n, k)) for k in CHECKPOINT_KINDS]
    for url, tombstone in manifests:
        folder = url.removesuffix("/" + MANIFEST_NAME)
        if layout.store.exists(url):
            if (manifest := _manifest(layout, url, report)) is not None:
                if tombstone is not None and layout.store.exists(tombstone):
                    report.pruned.append(folder)  # retention removed the files; the manifest still counts
                    continue
                _check_files(layout, manifest, report, progress)
        elif layout.store.list_files(folder):
            report.uncommitted.append(folder)
    return report


def committed_bytes(layout: RunLayout) -> int:
    """Bytes `verify_run` will hash (for a progress bar); manifests that do not parse count 0."""
    total = 0
    for n in layout.iterations():
        for stage in STAGES:
            total += _listed_bytes(layout, layout.stage_manifest(n, stage))
    for n in layout.checkpoint_iterations():
        for kind in CHECKPOINT_KINDS:
            total += _listed_bytes(layout, layout.checkpoint_manifest(n, kind))
    return total


def _listed_bytes(layout: RunLayout, url: str) -> int:
    if not layout.store.exists(url):
        return 0
    try:
        data: Any = json.loads(layout.store.read_bytes(url))
    except (ValueError, UnicodeDecodeError):
        return 0
    return sum(int(f.get("bytes", 0)) for f in data.get("files", []))
