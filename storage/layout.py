"""The run layout: every path of a run is built here and nowhere else.

```
<root>/<run>/run.json                                   config frozen at creation (+ hash, code version)
<root>/<run>/config_changes.jsonl                       accepted config changes (allow_config_change=True)
<root>/<run>/LATEST                                     last committed iteration (replaced atomically)
<root>/<run>/LOCK                                       run lock (see storage.lock)
<root>/<run>/fork.json                                  a fork's parent and starting iteration (see storage.fork)
<root>/<run>/summary.json                               the run summary, written last when the run is done (storage.summary)
<root>/<run>/iter-<n>/_manifest.json                    iteration manifest: the commit of iteration n
<root>/<run>/iter-<n>/<stage>/part-<i>.parquet          stage shards (stage: rollout | teacher | train | eval)
<root>/<run>/iter-<n>/<stage>/<name>                    other stage files (e.g. train metrics)
<root>/<run>/iter-<n>/<stage>/_manifest.json            stage manifest, written last
<root>/<run>/checkpoints/iter-<n>/<kind>/files/...      weights produced by iteration n (policy | teacher | megatron)
<root>/<run>/checkpoints/iter-<n>/<kind>/_manifest.json checkpoint manifest, written last
<root>/<run>/checkpoints/iter-<n>/<kind>/_pruned.json   tombstone: retention removed the files (storage.retention)
```

Manifests name files relative to the run directory, so a run can be copied between stores.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from storage.credentials import check_record
from storage.errors import ConfigMismatchError
from storage.objects import ObjectStore
from storage.provenance import code_version, utc_now
from storage.retry import RetryPolicy
from storage.urls import join, normalize

logger = logging.getLogger(__name__)

LAYOUT_VERSION = 2  # 2: every manifest of the run records its content digest (storage.manifest)
# rollout / teacher / train: an iteration's stages; eval: a checkpoint's evaluation; baseline and
# discovery: iteration 0 of a test-time run (tasks/test_time.py)
STAGES = ("rollout", "teacher", "train", "eval", "baseline", "discovery")
CHECKPOINT_KINDS = ("policy", "teacher", "megatron")
MANIFEST_NAME = "_manifest.json"
TOMBSTONE_NAME = "_pruned.json"
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_ITER_DIR = re.compile(r"^iter-(0|[1-9][0-9]*)$")


def canonical_json(obj: Any) -> bytes:
    """Stable bytes for hashing and storing: sorted keys, no NaN."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def config_hash(config: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of a config dict."""
    return hashlib.sha256(canonical_json(config)).hexdigest()


@dataclass(frozen=True)
class RunLayout:
    """Paths (as URLs) of one run under `root_url`, plus the store that reads and writes them."""

    root_url: str
    run_name: str
    storage_options: Mapping[str, Any] | None = field(default=None, repr=False, compare=False)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    _store: ObjectStore = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _RUN_NAME.match(self.run_name):
            raise ValueError(f"run name {self.run_name!r} must match {_RUN_NAME.pattern}")
        object.__setattr__(self, "root_url", normalize(self.root_url))
        store = ObjectStore(self.root_url, storage_options=self.storage_options, retry=self.retry)
        object.__setattr__(self, "_store", store)

    @property
    def store(self) -> ObjectStore:
        return self._store

    # -- run-level paths ------------------------------------------------------------------
    @property
    def run_url(self) -> str:
        return join(self.root_url, self.run_name)

    def url(self, relative: str) -> str:
        """URL of a path relative to the run directory (as written in manifests)."""
        return join(self.run_url, relative)

    def relative(self, url: str) -> str:
        """Path of `url` relative to the run directory; fails for URLs outside the run."""
        prefix = self.run_url + "/"
        if not url.startswith(prefix):
            raise ValueError(f"{url} is not inside run {self.run_url}")
        return url[len(prefix) :]

    @property
    def local_dir(self) -> Path | None:
        """The run directory on local disk for file:// roots (for tools that need a path), else None."""
        if self.store.backend != "file":
            return None
        return Path(self.store.path(self.run_url))

    @property
    def run_json(self) -> str:
        return self.url("run.json")

    @property
    def fork_json(self) -> str:
        """A fork's record of its parent (storage.fork)."""
        return self.url("fork.json")

    @property
    def summary_json(self) -> str:
        """The run summary of a finished run (storage.summary)."""
        return self.url("summary.json")

    @property
    def config_changes(self) -> str:
        return self.url("config_changes.jsonl")

    @property
    def latest(self) -> str:
        return self.url("LATEST")

    @property
    def lock(self) -> str:
        return self.url("LOCK")

    # -- iteration / stage paths ----------------------------------------------------------
    def iteration_dir(self, n: int) -> str:
        return self.url(iteration_name(n))

    def iteration_manifest(self, n: int) -> str:
        return join(self.iteration_dir(n), MANIFEST_NAME)

    def stage_dir(self, n: int, stage: str) -> str:
        check_stage(stage)
        return join(self.iteration_dir(n), stage)

    def stage_manifest(self, n: int, stage: str) -> str:
        return join(self.stage_dir(n, stage), MANIFEST_NAME)

    def stage_file(self, n: int, stage: str, name: str) -> str:
        if name == MANIFEST_NAME or "/" in name:
            raise ValueError(f"stage file name {name!r} is reserved or nested")
        return join(self.stage_dir(n, stage), name)

    def shard(self, n: int, stage: str, index: int) -> str:
        if index < 0:
            raise ValueError(f"shard index must be >= 0, got {index}")
        return self.stage_file(n, stage, f"part-{index:05d}.parquet")

    def iterations(self) -> list[int]:
        """Iterations that have a directory (committed or not), ascending."""
        names = self.store.list_dirs(self.run_url)
        return sorted(int(m.group(1)) for m in map(_ITER_DIR.match, names) if m)

    # -- checkpoint paths -----------------------------------------------------------------
    @property
    def checkpoints_dir(self) -> str:
        return self.url("checkpoints")

    def checkpoint_dir(self, n: int, kind: str) -> str:
        check_checkpoint_kind(kind)
        return join(self.checkpoints_dir, iteration_name(n), kind)

    def checkpoint_files_dir(self, n: int, kind: str) -> str:
        return join(self.checkpoint_dir(n, kind), "files")

    def checkpoint_manifest(self, n: int, kind: str) -> str:
        return join(self.checkpoint_dir(n, kind), MANIFEST_NAME)

    def checkpoint_tombstone(self, n: int, kind: str) -> str:
        """Written when retention removes the checkpoint's files (its manifest stays)."""
        return join(self.checkpoint_dir(n, kind), TOMBSTONE_NAME)

    @property
    def retention_record(self) -> str:
        """Where the last retention pass left off (storage/retention.py); derivable from the checkpoints."""
        return join(self.checkpoints_dir, "_retention.json")

    def checkpoint_iterations(self) -> list[int]:
        """Iterations that have a checkpoint directory, ascending."""
        names = self.store.list_dirs(self.checkpoints_dir)
        return sorted(int(m.group(1)) for m in map(_ITER_DIR.match, names) if m)

    def checkpoint_inventory(self) -> dict[tuple[int, str], CheckpointListing]:
        """Every checkpoint directory from one recursive listing (a few requests on S3, however long the
        run): (iteration, kind) -> what it holds (manifest, tombstone, files) and its files' bytes."""
        store = self.store
        prefix = store.path(self.checkpoints_dir).rstrip("/") + "/"
        inventory: dict[tuple[int, str], CheckpointListing] = {}
        for url, size in store.list_file_sizes(self.checkpoints_dir).items():
            parts = store.path(url)[len(prefix) :].split("/")
            match = _ITER_DIR.match(parts[0])
            if not match or len(parts) < 3 or parts[1] not in CHECKPOINT_KINDS:
                continue
            listing = inventory.setdefault((int(match.group(1)), parts[1]), CheckpointListing())
            if parts[2] == MANIFEST_NAME:
                listing.held.add("manifest")
            elif parts[2] == TOMBSTONE_NAME:
                listing.held.add("tombstone")
            elif parts[2] == "files" and len(parts) > 3:
                listing.held.add("files")
                listing.bytes += size
        return inventory


@dataclass
class CheckpointListing:
    """What one checkpoint directory holds: of "manifest", "tombstone", "files", and the bytes of its files."""

    held: set[str] = field(default_factory=set)
    bytes: int = 0


def iteration_name(n: int) -> str:
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"iteration must be an int >= 0, got {n!r}")
    return f"iter-{n}"


def parse_iteration_name(name: str) -> int:
    match = _ITER_DIR.match(name)
    if not match:
        raise ValueError(f"{name!r} is not an iteration name like 'iter-3'")
    return int(match.group(1))


def check_stage(stage: str) -> None:
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; stages are {STAGES}")


def check_checkpoint_kind(kind: str) -> None:
    if kind not in CHECKPOINT_KINDS:
        raise ValueError(f"unknown checkpoint kind {kind!r}; kinds are {CHECKPOINT_KINDS}")


# -- run.json and config changes ------------------------------------------------------------
def _check_plain(value: Any, key: str) -> None:
    """Config must be plain JSON data, without storage options (they may hold credentials)."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"config key {k!r} under {key or '<root>'} is not a string")
            dotted = f"{key}.{k}" if key else k
            if k == "storage_options" and v:  # whatever their names: they may hold credentials
                raise ValueError(
                    f"config key {dotted!r}: storage options are never written to run.json; give them to "
                    "RunLayout in-process, credentials through the environment or a named profile"
                )
            _check_plain(v, dotted)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_plain(v, f"{key}[{i}]")
    elif value is not None and not isinstance(value, str | int | float | bool):
        raise TypeError(f"config value at {key!r} has type {type(value).__name__}; only JSON data is allowed")


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in config.items():
        dotted = f"{prefix}.{k}" if prefix else k
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, dotted))
        else:
            out[dotted] = v
    return out


_ABSENT = "<absent>"


def config_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """[(dotted key, old, new)] for every leaf that differs; missing leaves show as '<absent>'."""
    a, b = _flatten(old), _flatten(new)
    diff = []
    for key in sorted(a.keys() | b.keys()):
        va, vb = a.get(key, _ABSENT), b.get(key, _ABSENT)
        if canonical_json(va) != canonical_json(vb):
            diff.append((key, va, vb))
    return diff


def format_config_diff(diff: list[tuple[str, Any, Any]]) -> str:
    return "\n".join(f"  {key}: {json.dumps(old)} -> {json.dumps(new)}" for key, old, new in diff)


def read_config_changes(layout: RunLayout) -> list[dict[str, Any]]:
    """The accepted config changes of a run, oldest first (entries of config_changes.jsonl)."""
    if not layout.store.exists(layout.config_changes):
        return []
    text = layout.store.read_bytes(layout.config_changes).decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def read_run(layout: RunLayout) -> dict[str, Any]:
    """run.json with `config` and `config_hash` replaced by the effective (latest accepted) config."""
    if not layout.store.exists(layout.run_json):
        raise FileNotFoundError(f"run {layout.run_name!r} does not exist: no {layout.run_json}")
    record: dict[str, Any] = json.loads(layout.store.read_bytes(layout.run_json))
    changes = read_config_changes(layout)
    if changes:
        record["config"] = changes[-1]["config"]
        record["config_hash"] = changes[-1]["config_hash"]
    record["config_changes"] = len(changes)
    return record


def read_run_config(layout: RunLayout) -> dict[str, Any]:
    """The effective config of an existing run (as created, plus accepted changes)."""
    config: dict[str, Any] = read_run(layout)["config"]
    return config


def _mismatch(layout: RunLayout, diff_text: str) -> ConfigMismatchError:
    return ConfigMismatchError(
        f"run {layout.run_name!r} was created with another config; differences (old -> new):\n{diff_text}\n"
        "pass allow_config_change=True (sdpo run --allow-config-change) to accept and record the change"
    )


def check_config_unchanged(
    layout: RunLayout,
    config: Mapping[str, Any],
    *,
    resolve: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
) -> None:
    """Raise the ConfigMismatchError `create_or_open_run` would raise for `config`, reading only;
    nothing when the run does not exist yet or has this config. Lets a command refuse a changed
    config before it starts anything; `create_or_open_run` checks again under the run lock."""
    if not layout.store.exists(layout.run_json):
        return
    existing = read_run(layout)["config"]
    diff = config_diff(resolve(existing) if resolve else existing, json.loads(canonical_json(config)))
    if diff:
        raise _mismatch(layout, format_config_diff(diff))


def create_or_open_run(
    layout: RunLayout,
    config: Mapping[str, Any],
    *,
    allow_config_change: bool = False,
    resolve: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """Create the run with `config` frozen in run.json, or open it and check the config is unchanged.

    A different config raises ConfigMismatchError listing `key: old -> new`; with
    `allow_config_change=True` the change is accepted and appended to config_changes.jsonl.
    `resolve` reads the stored config as the current code would (the config tree's defaults filled
    in for keys added since the run was created), so a code upgrade that only adds settings whose
    defaults keep the old behaviour is no change; the comparison is with what it returns.
    Returns the run record with the effective config (see `read_run`).
    """
    _check_plain(config, "")
    check_record(config, record=f"the config of run {layout.run_name!r} (run.json, config_changes.jsonl)")
    config = json.loads(canonical_json(config))
    record: dict[str, Any] = {
        "layout_version": LAYOUT_VERSION,
        "run": layout.run_name,
        "created_at": utc_now(),
        "code_version": code_version(),
        "config_hash": config_hash(config),
        "config": config,
    }
    try:
        layout.store.create_exclusive(layout.run_json, json.dumps(record, indent=1, sort_keys=True).encode())
        logger.info("created run %s at %s (config %s)", layout.run_name, layout.run_url, record["config_hash"][:12])
        return read_run(layout)
    except FileExistsError:
        pass
    existing = read_run(layout)
    diff = config_diff(resolve(existing["config"]) if resolve else existing["config"], config)
    if not diff:
        return existing
    text = format_config_diff(diff)
    if not allow_config_change:
        raise _mismatch(layout, text)
    change = {
        "changed_at": utc_now(),
        "code_version": code_version(),
        "config_hash_old": existing["config_hash"],
        "config_hash": config_hash(config),
        "diff": [{"key": k, "old": old, "new": new} for k, old, new in diff],
        "config": config,
    }
    lines = [json.dumps(c, sort_keys=True) for c in [*read_config_changes(layout), change]]
    layout.store.write_bytes(layout.config_changes, ("\n".join(lines) + "\n").encode())
    logger.warning("run %s: config change accepted and recorded:\n%s", layout.run_name, text)
    return read_run(layout)
