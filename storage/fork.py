"""Fork a run: a new run that starts from a committed iteration of another.

The child gets byte-identical copies of everything the parent committed up to iteration n (stage
shards and manifests, checkpoints with the optimizer state and data cursor, evaluations, the
iteration manifests), then `fork.json` naming its parent, then LATEST = n, then its own run.json
(written last: a fork interrupted before it is not a run yet, and forking again redoes it).
Uncommitted attempts of the parent (folders without a manifest) are not copied. Manifests name
files relative to the run directory, so the copies check out against their digests in the child;
they still name the parent as the run that wrote them, which is what happened.

```
<root>/<child>/fork.json   {parent, parent_run_url, iteration, iteration_manifest_sha256, forked_at, changes}
```

`changes` lists the settings the fork changed, `[key, parent's value, fork's value]` by dotted key
(`sdpo compare`'s legend and the fork's MLflow run name them); a fork.json written before it was
recorded has none, and its changes are then not known.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from storage.errors import ChecksumMismatchError
from storage.hashing import sha256_bytes
from storage.layout import CHECKPOINT_KINDS, STAGES, RunLayout, config_diff, create_or_open_run, read_run_config
from storage.manifest import Manifest, _move_latest, read_iteration_manifest, read_manifest, verify_latest
from storage.provenance import utc_now

logger = logging.getLogger(__name__)


def _committed_manifests(layout: RunLayout, n: int) -> list[str]:
    """URLs of every manifest of iterations 0..n: stages, checkpoints, iteration manifests."""
    urls = []
    for m in range(n + 1):
        urls += [layout.stage_manifest(m, s) for s in STAGES if layout.store.exists(layout.stage_manifest(m, s))]
        urls += [
            layout.checkpoint_manifest(m, k)
            for k in CHECKPOINT_KINDS
            if layout.store.exists(layout.checkpoint_manifest(m, k))
        ]
        if m > 0:
            urls.append(layout.iteration_manifest(m))
    return urls


def _copy_committed(parent: RunLayout, child: RunLayout, manifest: Manifest) -> int:
    """Copy a manifest's files (each checked against its digest), then the manifest; returns bytes copied."""
    copied = 0
    for entry in manifest.data.get("files", []):
        data = parent.store.read_bytes(parent.url(entry["path"]))
        if sha256_bytes(data) != entry["sha256"]:
            raise ChecksumMismatchError(parent.url(entry["path"]), expected=entry["sha256"], actual=sha256_bytes(data))
        child.store.write_bytes(child.url(entry["path"]), data)
        copied += len(data)
    child.store.write_bytes(child.url(manifest.path), parent.store.read_bytes(parent.url(manifest.path)))
    return copied


def fork_run(parent: RunLayout, child: RunLayout, *, iteration: int, config: Mapping[str, Any]) -> dict[str, Any]:
    """Create run `child` (with `config`, whose name is the child's) from iteration `iteration` of `parent`.

    Returns the fork record. Refuses an iteration the parent has not committed and a child that exists.
    """
    latest = verify_latest(parent)
    if latest is None or not 1 <= iteration <= latest:
        raise ValueError(
            f"run {parent.run_name!r} has committed iterations 1..{latest or 0}; cannot fork from iteration {iteration}"
        )
    if child.store.exists(child.run_json):
        raise FileExistsError(f"run {child.run_name!r} already exists at {child.run_url}; pick another name")
    if config.get("name") != child.run_name:
        raise ValueError(f"the fork's config is named {config.get('name')!r}, its run {child.run_name!r}")
    changes = [list(d) for d in config_diff(read_run_config(parent), config) if d[0] != "name"]
    copied = 0
    for url in _committed_manifests(parent, iteration):
        copied += _copy_committed(parent, child, read_manifest(parent, url))
    head = read_iteration_manifest(child, iteration)
    record = {
        "parent": parent.run_name,
        "parent_run_url": parent.run_url,
        "iteration": iteration,
        "iteration_manifest_sha256": head.sha256,
        "forked_at": utc_now(),
        "changes": changes,
    }
    child.store.write_bytes(child.fork_json, json.dumps(record, indent=1, sort_keys=True).encode())
    _move_latest(child, head, iteration)
    create_or_open_run(child, config)
    logger.info(
        "forked %s at iteration %d into %s (%.1f MiB copied)", parent.run_url, iteration, child.run_url, copied / 2**20
    )
    return record


def read_fork(layout: RunLayout) -> dict[str, Any] | None:
    """The fork record of a run (its parent and the iteration it started from), or None for a run that was not forked."""
    if not layout.store.exists(layout.fork_json):
        return None
    record: dict[str, Any] = json.loads(layout.store.read_bytes(layout.fork_json))
    return record


def forked_at(layout: RunLayout) -> int:
    """The iteration run `layout` was forked from (its iterations 1..n are its parent's), 0 for a
    run that was not forked."""
    record = read_fork(layout)
    return 0 if record is None else int(record["iteration"])


def describe_changes(record: Mapping[str, Any]) -> str:
    """A fork's changed settings as `key old -> new`, `; `-separated; "its changes are not
    recorded" for a fork.json of a version that did not record them, "no setting changed" for none."""
    if "changes" not in record:
        return "its changes are not recorded"
    changes = record["changes"]
    if not changes:
        return "no setting changed"
    return "; ".join(f"{key} {json.dumps(old)} -> {json.dumps(new)}" for key, old, new in changes)
