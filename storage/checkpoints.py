"""Checkpoints: upload a local folder with a manifest, download it into a digest-keyed cache, lineage.

`checkpoints/iter-<n>/<kind>/` holds the weights iteration n's train stage produced, any folder shape
(HF safetensors, Megatron distributed checkpoint with sub-directories). Kinds: policy (HF weights for
the engines), teacher (a separately kept teacher, e.g. EMA), megatron (distributed checkpoint with
optimizer state, for resuming training).
The manifest digest identifies the checkpoint; the local cache is `<cache_dir>/<digest>/`, reused
when present and verified. Each manifest names its parent checkpoint (or an external base model)
and the stage manifests it was trained on, which `lineage` follows.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storage.errors import AlreadyCommittedError, ChecksumMismatchError, NotCommittedError
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
from storage.objects import sha256_local_file
from storage.retention import check_not_pruned, is_pruned
from storage.scratch import owner_tag
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
) -> Manifest:
    """Upload every file under `local_dir` (recursively) as checkpoint `kind` of iteration n.

    `parent`: the checkpoint these weights were trained from (its manifest), an external reference
    such as a base model name (str), or None. `trained_on`: the stage manifests of the training data.
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
        digest = layout.store.put_local_file(path, url)
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
        if verify and sha256_local_file(path) != entry["sha256"]:
            return f"{name} sha256 differs from the manifest"
    return None


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
    one is downloaded again. Downloads land in a temp folder renamed into place when complete. With
    `max_cache_bytes`, the least recently used checkpoints are evicted after a download until the
    cache's checkpoints fit (never the one returned).
    """
    manifest = resolve_checkpoint(layout, ref, kind)
    check_not_pruned(layout, checkpoint_iteration(layout, ref), kind)
    cache = Path(cache_dir)
    target = cache / manifest.sha256
    if target.is_dir():
        problem = _local_copy_problem(target, manifest, verify=verify)
        if problem is None:
            logger.info("checkpoint %s %s: using cached %s", kind, ref, target)
            os.utime(target)  # recently used: the last to be evicted from a bounded cache
            return target
        logger.warning("cached checkpoint %s is damaged (%s); downloading again", target, problem)
        shutil.rmtree(target)
    tmp = cache / f".{manifest.sha256}.tmp{owner_tag()}"
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
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
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
    `max_cache_bytes` bounds the cache as a download does: older checkpoints are evicted first.
    """
    source, target = Path(local_dir), Path(cache_dir) / manifest.sha256
    problem = _local_copy_problem(source, manifest, verify=False)
    if problem is not None:
        raise ValueError(f"{source} is not the upload of {manifest.path}: {problem}")
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(source, target)
    except OSError:  # a reader downloaded it meanwhile
        if not target.is_dir():
            raise
    if max_cache_bytes is not None:
        evict_least_recently_used(target.parent, max_bytes=max_cache_bytes, keep=target)
    return target


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def evict_least_recently_used(cache_dir: Path, *, max_bytes: int, keep: Path) -> list[Path]:
    """Remove cached checkpoints (`<cache_dir>/<64 hex digits>/`), least recently used first, until
    they hold at most `max_bytes`; `keep` stays. Returns the removed folders."""
    entries = [p for p in cache_dir.iterdir() if p.is_dir() and len(p.name) == 64 and p != keep]
    sizes = {p: _folder_bytes(p) for p in entries}
    total = sum(sizes.values()) + (_folder_bytes(keep) if keep.is_dir() else 0)
    removed = []
    for folder in sorted(entries, key=lambda p: p.stat().st_mtime):
        if total <= max_bytes:
            break
        shutil.rmtree(folder, ignore_errors=True)
        total -= sizes[folder]
        removed.append(folder)
    if removed:
        logger.info(
            "evicted %d checkpoint(s) from the cache %s to stay under %d bytes", len(removed), cache_dir, max_bytes
        )
    return removed


def download_checkpoint_files(
    layout: RunLayout,
    ref: str | int,
    kind: str = "policy",
    *,
    include: Callable[[str], bool],
    cache_dir: str | os.PathLike[str],
    verify: bool = True,
) -> Path:
    """Local folder holding only the files of checkpoint `ref` whose names pass `include`.

    For readers that need part of a checkpoint (a tokenizer without the weights). The folder is
    `<cache_dir>/<manifest digest>-<digest of the chosen names>/`, reused when its files match the
    manifest (sha256 when `verify`); fails when `include` keeps no file.
    """
    manifest = resolve_checkpoint(layout, ref, kind)
    entries = [e for e in manifest.data["files"] if include(e["name"])]
    if not entries:
        names = [e["name"] for e in manifest.data["files"]][:8]
        raise FileNotFoundError(f"checkpoint {kind} of {ref} has no file that `include` keeps; files: {names}")
    chosen = hashlib.sha256("\n".join(sorted(e["name"] for e in entries)).encode()).hexdigest()[:16]
    target = Path(cache_dir) / f"{manifest.sha256}-{chosen}"
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
        committed_refs = read_iteration_manifest(layout, n).data["checkpoints"] if committed else {}
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
