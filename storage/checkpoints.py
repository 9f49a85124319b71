"""Checkpoints: upload a local folder with a manifest, resolve references, lineage.

`checkpoints/iter-<n>/<kind>/` holds the weights iteration n's train stage produced, any folder shape
(HF safetensors, Megatron distributed checkpoint with sub-directories). Kinds: policy (HF weights for
the engines), teacher (a separately kept teacher, e.g. EMA), megatron (distributed checkpoint with
optimizer state, for resuming training).
The manifest digest identifies the checkpoint (`storage.cache` keeps local copies by it). Each manifest names its parent checkpoint (or an external base model)
and the stage manifests it was trained on, which `lineage` follows.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storage.errors import AlreadyCommittedError, NotCommittedError
from storage.faults import crash_point
from storage.layout import CHECKPOINT_KINDS, MANIFEST_NAME, RunLayout, parse_iteration_name
from storage.manifest import (
    Manifest,
    base_fields,
    iteration_committed,
    read_iteration_manifest,
    read_latest,
    read_manifest,
    verify_ref,
    write_manifest,
)
from storage.retention import is_pruned
from storage.urls import join

logger = logging.getLogger(__name__)


def checkpoint_iteration(layout: RunLayout, ref: str | int) -> int:
    """The iteration a checkpoint reference names: "latest" (the LATEST iteration), "iter-N" or N."""
    if isinstance(ref, int):
        return ref
    if ref == "latest":
        latest = read_latest(layout)
        if latest is None:
            raise NotCommittedError(f"run {layout.run_name!r} has no committed iteration, so no latest checkpoint")
        return latest
    return parse_iteration_name(ref)


def checkpoint_exists(layout: RunLayout, ref: str | int, kind: str) -> bool:
    """Whether checkpoint `kind` of `ref` is committed (its manifest exists)."""
    return layout.store.exists(layout.checkpoint_manifest(checkpoint_iteration(layout, ref), kind))


def read_checkpoint_manifest(layout: RunLayout, n: int, kind: str) -> Manifest:
    return read_manifest(layout, layout.checkpoint_manifest(n, kind))


def _ref(item: Manifest | Mapping[str, str]) -> dict[str, str]:
    return item.ref if isinstance(item, Manifest) else dict(item)


def upload_checkpoint(
    local_dir: str | os.PathLike[str],
    layout: RunLayout,
    n: int,
    kind: str,
    *,
    parent: Manifest | str | None,
    trained_on: Sequence[Manifest | Mapping[str, str]] = (),
    metadata: Mapping[str, Any] | None = None,
    handed_over: bool = False,
    written: Mapping[str, str] | None = None,
) -> Manifest:
    """Upload every file under `local_dir` (recursively) as checkpoint `kind` of iteration n.

    `parent`: the checkpoint these weights were trained from (its manifest), an external reference
    such as a base model name (str), or None. `trained_on`: the stage manifests of the training data.
    `handed_over`: the folder's files are the caller's to give away, and nothing writes them again
    (a stage's scratch output); a file:// store on their file system then takes them as hard
    links, without copying the bytes (`ObjectStore.put_local_file`).
    `written`: file name (relative to `local_dir`) -> the sha256 its writer took as it wrote it
    (`storage.objects.write_local_hashing`); such a file is not read again to learn its digest.
    Refuses a committed checkpoint; clears a partial upload (files without manifest) first.
    """
    source = Path(local_dir)
    if not source.is_dir():
        raise NotADirectoryError(f"checkpoint folder {source} does not exist")
    if checkpoint_exists(layout, n, kind):
        raise AlreadyCommittedError(
            f"checkpoint {kind} of iteration {n} is committed ({layout.checkpoint_manifest(n, kind)}); "
            "committed outputs are never overwritten"
        )
    target = layout.checkpoint_dir(n, kind)
    if leftovers := layout.store.list_files(target):
        logger.warning(
            "checkpoint %s of iteration %d: clearing %d file(s) of a partial upload", kind, n, len(leftovers)
        )
        layout.store.remove_tree(target)
    files = sorted(p for p in source.rglob("*") if p.is_file())
    if not files:
        raise ValueError(f"checkpoint folder {source} holds no files")
    if unknown := sorted(set(written or {}) - {p.relative_to(source).as_posix() for p in files}):
        raise ValueError(f"checkpoint folder {source} holds no files {unknown}, for which digests were given")
    parent_ref: dict[str, str] | None
    if isinstance(parent, str):
        parent_ref = {"external": parent}
    else:
        parent_ref = None if parent is None else verify_ref(layout, parent.ref).ref
    trained_refs = [verify_ref(layout, _ref(m)).ref for m in trained_on]

    started = time.monotonic()
    entries: list[dict[str, Any]] = []
    for path in files:
        name = path.relative_to(source).as_posix()
        url = join(layout.checkpoint_files_dir(n, kind), name)
        digest = layout.store.put_local_file(path, url, link=handed_over, sha256=(written or {}).get(name))
        crash_point(f"checkpoint.uploading:{kind}", n)
        entries.append({"name": name, "path": layout.relative(url), "bytes": path.stat().st_size, "sha256": digest})
    data = {
        **base_fields(layout, "checkpoint"),
        "iteration": n,
        "checkpoint": kind,
        "files": entries,
        "bytes": sum(e["bytes"] for e in entries),
        "parent": parent_ref,
        "trained_on": trained_refs,
        "metadata": dict(metadata or {}),
        "timings": {"upload_s": round(time.monotonic() - started, 3)},
    }
    manifest = write_manifest(layout, layout.checkpoint_manifest(n, kind), data)
    crash_point(f"checkpoint.committed:{kind}", n)
    logger.info(
        "uploaded checkpoint %s of iteration %d: %d files, %d bytes (%s)",
        kind,
        n,
        len(entries),
        data["bytes"],
        manifest.sha256[:12],
    )
    return manifest


def discard_checkpoint(layout: RunLayout, n: int, kind: str) -> bool:
    """Remove checkpoint `kind` of iteration n, manifest first (a kill in between leaves a partial
    upload, which the next upload clears). Only for outputs of a stage that did not commit: the
    train stage discards the checkpoints a killed attempt wrote before its own manifest. Returns
    whether anything was there."""
    manifest_url = layout.checkpoint_manifest(n, kind)
    files = layout.store.list_files(layout.checkpoint_dir(n, kind))
    if not files:
        return False
    layout.store.remove_file(manifest_url)
    layout.store.remove_tree(layout.checkpoint_dir(n, kind))
    logger.warning(
        "discarded checkpoint %s of iteration %d (%d file(s)) written by an attempt that did not commit",
        kind,
        n,
        len(files),
    )
    return True


def resolve_checkpoint(layout: RunLayout, ref: str | int, kind: str = "policy") -> Manifest:
    """The checkpoint manifest for `ref`: "latest" (of the last committed iteration), "iter-N" or N."""
    return read_checkpoint_manifest(layout, checkpoint_iteration(layout, ref), kind)


# -- lineage ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class LineageRecord:
    iteration: int
    kind: str
    sha256: str
    parent: str | None  # "iter-2/policy@<digest12>", an external reference, or None
    parent_ok: bool | None  # the parent manifest still has the recorded digest; None when nothing to check
    trained_on: tuple[str, ...]  # "iter-3/teacher@<digest12>"
    trained_on_ok: bool | None  # every training-data manifest still has its recorded digest; None if none
    committed: bool  # iteration n is committed and its manifest names this checkpoint (n=0: the base model)
    pruned: bool  # retention removed its files (the manifest, and so the chain of digests, stays)
    bytes: int
    created_at: str


def _describe(ref: Mapping[str, str]) -> str:
    path = ref["path"].removeprefix("checkpoints/").removesuffix("/" + MANIFEST_NAME)
    return f"{path}@{ref['sha256'][:12]}"


def _ref_ok(layout: RunLayout, ref: Mapping[str, str]) -> bool:
    """Whether the manifest `ref` names still exists with the digest recorded in `ref`."""
    url = layout.url(ref["path"])
    return layout.store.exists(url) and read_manifest(layout, url).sha256 == ref["sha256"]


def lineage(layout: RunLayout) -> list[LineageRecord]:
    """Every committed checkpoint of the run, oldest first, with its parent and training data.

    Each digest a checkpoint records (its parent's and its training data's) is checked against the
    manifest it names. Checkpoints of iteration 0 (the base model) have no iteration commit: their
    own manifest commits them.
    """
    records = []
    for n in layout.checkpoint_iterations():
        committed = iteration_committed(layout, n)
        committed_refs = dict(read_iteration_manifest(layout, n).data["checkpoints"]) if committed else {}
        if "megatron" not in committed_refs and (background := _full_state_named_later(layout, n)) is not None:
            committed_refs["megatron"] = background
        for kind in CHECKPOINT_KINDS:
            if not checkpoint_exists(layout, n, kind):
                continue
            manifest = read_checkpoint_manifest(layout, n, kind)
            parent = manifest.data["parent"]
            parent_text: str | None = None
            parent_ok: bool | None = None
            if parent is not None and "external" in parent:
                parent_text = parent["external"]
            elif parent is not None:
                parent_text = _describe(parent)
                parent_ok = _ref_ok(layout, parent)
            trained_on = manifest.data["trained_on"]
            records.append(
                LineageRecord(
                    iteration=n,
                    kind=kind,
                    sha256=manifest.sha256,
                    parent=parent_text,
                    parent_ok=parent_ok,
                    trained_on=tuple(_describe(r) for r in trained_on),
                    trained_on_ok=all(_ref_ok(layout, r) for r in trained_on) if trained_on else None,
                    committed=n == 0 or (kind in committed_refs and committed_refs[kind]["sha256"] == manifest.sha256),
                    pruned=is_pruned(layout, n, kind),
                    bytes=manifest.data["bytes"],
                    created_at=manifest.data["created_at"],
                )
            )
    return records


def checkpoints_named(layout: RunLayout, train: Manifest, n: int) -> dict[str, dict[str, str]]:
    """kind -> reference, for each checkpoint of iteration n that the train stage manifest `train`
    names among its parents. A train stage names the checkpoints it saved itself, and a full state
    saved in the background by the previous one (which uploads it but cannot name it in time); an
    iteration commits exactly the checkpoints its train stage names."""
    parents = {ref.get("path"): dict(ref) for ref in train.data["parents"]}
    paths = {kind: layout.relative(layout.checkpoint_manifest(n, kind)) for kind in CHECKPOINT_KINDS}
    return {kind: parents[path] for kind, path in paths.items() if path in parents}


def _full_state_named_later(layout: RunLayout, n: int) -> dict[str, str] | None:
    """The reference to iteration n's full state that iteration n+1 committed (see `checkpoints_named`)."""
    if not iteration_committed(layout, n + 1):
        return None
    train = read_manifest(layout, layout.stage_manifest(n + 1, "train"))
    return checkpoints_named(layout, train, n).get("megatron")


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def format_lineage(records: Sequence[LineageRecord], *, title: str | None = None) -> str:
    """A table of `lineage(...)` for `sdpo lineage <run>`."""
    header = (
        "iter",
        "kind",
        "checkpoint",
        "parent",
        "parent ok",
        "trained on",
        "data ok",
        "committed",
        "size",
        "created",
    )
    rows = [
        (
            str(r.iteration),
            r.kind,
            r.sha256[:12],
            r.parent or "-",
            {True: "yes", False: "NO", None: "-"}[r.parent_ok],
            ", ".join(r.trained_on) or "-",
            {True: "yes", False: "NO", None: "-"}[r.trained_on_ok],
            ("yes" if r.committed else "no") + (" (pruned)" if r.pruned else ""),
            _size(r.bytes),
            r.created_at,
        )
        for r in records
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [title] if title else []
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in [header, *rows]]
    if not rows:
        lines.append("(no committed checkpoints)")
    return "\n".join(lines)
