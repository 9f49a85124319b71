"""Two runs of one config, file by file: what `sdpo verify RUN --compare OTHER` checks.

Two runs of one config with one code version commit the same files, and every file but the JSON
records below holds the same bytes: shards, checkpoint files (the distributed checkpoint's
`.metadata` included), evaluation metrics. The records also say when and how fast things happened,
so they are compared as JSON without:
- the wall-clock fields `created_at`, `updated_at`, `changed_at`, `forked_at`, `pruned_at` and
  `timings`, and the metrics whose names end in `seconds` or `per_second` (`storage.manifest.is_wall_clock`);
- the digests that follow from those: a manifest's `content_sha256` and `signature`, the `sha256` with which a
  record names a manifest (`{"path": ".../_manifest.json", "sha256": ...}`, `LATEST`), and a
  fork's `iteration_manifest_sha256`; each manifest named is compared itself;
- the run's name (`run`, the config's `name`), and the config hashes, which are mapped from one run
  to the other in order (the configs themselves are compared without their names).
- in the run summary (`summary.json`), the run's URL and every field named as wall-clock time,
  at any depth (its stage times and per-iteration metrics).
Where a record legitimately differs by how or where the run went, the comparison says so apart (a
note, not a difference): the config's storage and tracking settings (where the run lives and is
logged: what they change in the data shows in the files), the run summary's tracking store and
MLflow experiment, and a `summary.base` that an older version wrote without seeing the base model
(`{"source": "stored"}` after a resume, `{}` from scheduled one-iteration runs).
The records are the manifests (`_manifest.json`), the tombstones of pruned checkpoints
(`_pruned.json`), `LATEST`, `run.json`, `config_changes.jsonl`, `fork.json` and `summary.json`. `LOCK`, a live
writer's lease, is not compared.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from storage.anchor import SIGNATURE
from storage.hashing import sha256_bytes
from storage.layout import MANIFEST_NAME, TOMBSTONE_NAME, RunLayout
from storage.manifest import CONTENT_DIGEST, decode_json_object, is_wall_clock
from storage.verify import stored_sha256

RECORDS = ("LATEST", "run.json", "config_changes.jsonl", "fork.json", "summary.json")
RECORD_NAMES = (MANIFEST_NAME, TOMBSTONE_NAME)
WALL_CLOCK_FIELDS = ("created_at", "updated_at", "changed_at", "forked_at", "pruned_at", "written_at", "timings")
NOT_COMPARED = ("LOCK",)
_SHOWN = 20  # differences listed per record
# fields of the run summary that say where the run was logged, not what it computed
_WHERE_LOGGED = ("tracking_uri", "experiment_id")
_UNSEEN_BASES: tuple[dict[str, str], ...] = (
    {},
    {"source": "stored"},
)  # summary.base as older versions wrote it after a resume or schedule


@dataclass
class Comparison:
    """What `compare_runs` found: differences of trained state, data and metrics (one line each), and
    notes on records that differ only by how the run went (said apart, not differences)."""

    differences: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def is_record(path: str) -> bool:
    """Whether the run-relative `path` is a JSON record, compared without its wall-clock fields."""
    return path in RECORDS or path.rsplit("/", 1)[-1] in RECORD_NAMES


def _config_hashes(layout: RunLayout) -> dict[str, str]:
    """The run's config hashes (as created, then each accepted change) -> a name shared by both runs."""
    hashes = [decode_json_object(layout.run_json, layout.store.read_bytes(layout.run_json))["config_hash"]]
    if layout.store.exists(layout.config_changes):
        text = layout.store.read_bytes(layout.config_changes).decode()
        hashes += [json.loads(line)["config_hash"] for line in text.splitlines() if line.strip()]
    return {h: f"<config {i}>" for i, h in enumerate(hashes)}


def _names_manifest(value: Mapping[str, Any]) -> bool:
    path = value.get("path")
    return isinstance(path, str) and path.rsplit("/", 1)[-1] == MANIFEST_NAME and "sha256" in value


def normalise(value: Any, hashes: Mapping[str, str], *, top: bool = True) -> Any:
    """A record (decoded JSON) as two runs of one config share it (see the module doc)."""
    if isinstance(value, list):
        return [normalise(v, hashes, top=False) for v in value]
    if isinstance(value, str):
        return hashes.get(value, value)
    if not isinstance(value, dict):
        return value
    drop = set(WALL_CLOCK_FIELDS) if top else set()
    if top:
        drop |= {"run", CONTENT_DIGEST, SIGNATURE, "iteration_manifest_sha256"}
        if "manifest" in value:  # LATEST: the digest of the iteration manifest it names
            drop.add("sha256")
    if _names_manifest(value):
        drop.add("sha256")
    out: dict[str, Any] = {}
    for key, item in value.items():
        if key in drop:
            continue
        if key == "config" and isinstance(item, dict):
            item = {k: v for k, v in item.items() if k != "name"}
        if key == "metrics" and isinstance(item, dict):
            item = {k: v for k, v in item.items() if not is_wall_clock(k)}
        out[key] = normalise(item, hashes, top=False)
    return out


def _without_wall_clock(value: Any) -> Any:
    """`value` with every dict key named as wall-clock time removed, at any depth."""
    if isinstance(value, dict):
        return {k: _without_wall_clock(v) for k, v in value.items() if not is_wall_clock(k)}
    if isinstance(value, list):
        return [_without_wall_clock(v) for v in value]
    return value


def _record(layout: RunLayout, path: str, hashes: Mapping[str, str]) -> Any:
    """The record at `path`, normalised (a JSON-lines file: each line); its bytes when it does not decode."""
    payload = layout.store.read_bytes(layout.url(path))
    try:
        text = payload.decode()
        if path.endswith(".jsonl"):
            return [normalise(json.loads(line), hashes) for line in text.splitlines() if line.strip()]
        record = normalise(json.loads(text), hashes)
        if path == "summary.json" and isinstance(record, dict) and isinstance(record.get("summary"), dict):
            summary = {k: v for k, v in record["summary"].items() if k != "run_url"}
            record = {**record, "summary": _without_wall_clock(summary)}
        return record
    except (UnicodeDecodeError, json.JSONDecodeError):
        return f"<not JSON: {len(payload)} bytes, sha256 {sha256_bytes(payload)[:12]}>"


def _leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        return {
            k: v for key, item in value.items() for k, v in _leaves(item, f"{prefix}.{key}" if prefix else key).items()
        }
    if isinstance(value, list) and value:
        return {k: v for i, item in enumerate(value) for k, v in _leaves(item, f"{prefix}[{i}]").items()}
    return {prefix: value}


def _where_it_lives(leaf: str) -> bool:
    """Whether a record's leaf is a setting of where the run lives and is logged (the config's storage
    and tracking sections): what it trains does not depend on them, and whatever they change in the
    data (a shard's precision, the checkpoints retention keeps) is compared in the files themselves."""
    return re.search(r"(^|\.)config\.(storage|tracking)\.", leaf) is not None


def _record_differences(path: str, a: Any, b: Any) -> tuple[list[str], list[str]]:
    """(differences, notes) between two records: a leaf of where the run lives is a note."""
    left, right = _leaves(a), _leaves(b)
    keys = [k for k in sorted(left.keys() | right.keys()) if left.get(k, "<absent>") != right.get(k, "<absent>")]
    lines = {k: f"{path}: {k}: {left.get(k, '<absent>')!r} != {right.get(k, '<absent>')!r}" for k in keys}
    notes = [f"{lines[k]} (where the run lives)" for k in keys if _where_it_lives(k)]
    keys = [k for k in keys if not _where_it_lives(k)]
    out = [lines[k] for k in keys[:_SHOWN]]
    if len(keys) > _SHOWN:
        out.append(f"{path}: {len(keys) - _SHOWN} more difference(s)")
    return out, notes


def _how_it_went(a: Any, b: Any) -> tuple[Any, Any, list[str]]:
    """Two run summaries (records) without the fields that differ by how the run went, and a note for
    each of those that differs."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return a, b, []
    left, right = dict(a.get("summary", {})), dict(b.get("summary", {}))
    notes = []
    for key in _WHERE_LOGGED:
        if left.get(key) != right.get(key):
            notes.append(
                f"summary.json: summary.{key}: where the run was logged ({left.get(key)!r}, {right.get(key)!r})"
            )
        left.pop(key, None)
        right.pop(key, None)
    if left.get("base") != right.get("base") and (
        left.get("base") in _UNSEEN_BASES or right.get("base") in _UNSEEN_BASES
    ):
        notes.append(
            "summary.json: summary.base: written by a process that did not see the base model (a resumed or "
            "scheduled run of an older version); the base checkpoint itself is compared"
        )
        left.pop("base", None)
        right.pop("base", None)
    return {**a, "summary": left}, {**b, "summary": right}, notes


def compare_runs(a: RunLayout, b: RunLayout) -> Comparison:
    """Every difference between runs `a` and `b` that two runs of one config may not have (module
    doc), one line each, and notes on what differs only by how each run went; no differences when
    they committed the same."""
    files_a = {a.relative(u) for u in a.store.list_files(a.run_url)} - set(NOT_COMPARED)
    files_b = {b.relative(u) for u in b.store.list_files(b.run_url)} - set(NOT_COMPARED)
    result = Comparison()
    result.differences += [f"{p}: only in {a.run_url}" for p in sorted(files_a - files_b)]
    result.differences += [f"{p}: only in {b.run_url}" for p in sorted(files_b - files_a)]
    hashes_a, hashes_b = _config_hashes(a), _config_hashes(b)
    for path in sorted(files_a & files_b):
        if is_record(path):
            left, right = _record(a, path, hashes_a), _record(b, path, hashes_b)
            if path == "summary.json":
                left, right, notes = _how_it_went(left, right)
                result.notes += notes
            differences, notes = _record_differences(path, left, right)
            result.differences += differences
            result.notes += notes
        elif (left_sha := stored_sha256(a, a.url(path))) != (right_sha := stored_sha256(b, b.url(path))):
            result.differences.append(f"{path}: sha256 {left_sha[:12]} != {right_sha[:12]}")
    return result
