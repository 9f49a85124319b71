"""What a run reuses from an earlier attempt is checked against the digests recorded when it was written.

A run that starts again adopts what is committed: `LATEST`, the committed stages of the iteration
it resumes (each stage's manifest, the parents it names, the files it lists), an iteration manifest
written before `LATEST` moved, and the stage manifests the commit names. None of it is taken on
trust: a manifest's content is checked against the digest it recorded when written
(`storage.manifest.check_content`), a parent or a stage against the digest its child or the flow
recorded, a file against its manifest's size and sha256. What does not check out is refused with
`DamagedOutputError`, naming the file and saying what to do; nothing is repaired silently.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from storage.errors import ChecksumMismatchError, CorruptManifestError, DamagedOutputError, NotCommittedError
from storage.layout import RunLayout
from storage.manifest import ITERATION_STAGES, Manifest, read_manifest, verify_latest, verify_ref
from storage.verify import stored_sha256

# The stages of an iteration in the order each is computed from the one before: a stage computed
# again changes its manifest's digest, which the stages after it recorded, so they go with it.
_ORDER = (*ITERATION_STAGES, "eval")
_DAMAGE = (ChecksumMismatchError, CorruptManifestError, NotCommittedError)


@dataclass
class _Checking:
    """The URL being checked, so that a failure names it whichever check raised."""

    url: str = ""


def _audit(layout: RunLayout) -> str:
    return f"`sdpo verify {layout.run_name} --root {layout.root_url}` lists every damaged file"


def _redo(layout: RunLayout, n: int, stage: str) -> str:
    """How to compute `stage` of iteration n again: delete it and the stages after it that have files."""
    later = _ORDER[_ORDER.index(stage) + 1 :]
    folders = [layout.stage_dir(n, stage)]
    folders += [layout.stage_dir(n, s) for s in later if layout.store.list_files(layout.stage_dir(n, s))]
    return f"to compute it again, delete {', '.join(folders)} and run the same command again"


def adopt_latest(layout: RunLayout) -> int | None:
    """The committed iteration LATEST names, once LATEST checks out against its iteration manifest.
    With the signing key set, a failure names the first manifest whose signature does not check out
    (an edit of a committed stage shows first in the iteration manifests that cover it)."""
    from storage.anchor import signing_key
    from storage.departures import departures

    try:
        return verify_latest(layout)
    except _DAMAGE as exc:
        first = departures(layout, None) if signing_key() is not None else []
        if first:
            url, what = first[0]
            raise DamagedOutputError(url, f"{url} {what}. The run does not go on from it: {_audit(layout)}") from exc
        raise DamagedOutputError(
            layout.latest,
            f"{layout.latest} does not check out: {exc}. The run does not go on from it: {_audit(layout)}; when "
            f"only LATEST is damaged, delete {layout.latest} and run the same command again (the committed "
            "iterations are adopted again, in order, and LATEST is written anew)",
        ) from exc


def check_file(layout: RunLayout, entry: Mapping[str, Any], owner: str, *, hash_file: bool) -> None:
    """A file listed in the manifest at run-relative `owner`: present, of its size and (`hash_file`)
    of its sha256, the store's copy hashed."""
    url = layout.url(entry["path"])
    if not layout.store.exists(url):
        raise NotCommittedError(f"{url} is listed in {owner} but missing")
    if (size := layout.store.size(url)) != entry["bytes"]:
        raise NotCommittedError(f"{url} has {size} bytes, {owner} recorded {entry['bytes']}")
    if hash_file and (actual := stored_sha256(layout, url)) != entry["sha256"]:
        raise ChecksumMismatchError(url, expected=entry["sha256"], actual=actual)


def _check_manifest(layout: RunLayout, url: str, checking: _Checking, *, hash_files: bool) -> Manifest:
    """The stage manifest at `url`, its content checked, and the parents it names; its files when
    `hash_files` (sizes always)."""
    checking.url = url
    manifest = read_manifest(layout, url)
    for ref in manifest.data["parents"]:
        checking.url = layout.url(ref["path"])
        verify_ref(layout, ref)
    for entry in manifest.data["files"]:
        checking.url = layout.url(entry["path"])
        check_file(layout, entry, manifest.path, hash_file=hash_files)
    return manifest


def adopt_stage(layout: RunLayout, n: int, stage: str, *, hash_files: bool = True) -> Manifest:
    """Stage `stage` of iteration n, committed by an earlier attempt, after checking it: its manifest's
    content, the digests of the parents it names, and every file it lists (the sha256 of the store's
    copy with `hash_files`, else its size)."""
    checking = _Checking()
    try:
        manifest = _check_manifest(layout, layout.stage_manifest(n, stage), checking, hash_files=hash_files)
    except _DAMAGE as exc:
        raise DamagedOutputError(
            checking.url,
            f"stage {stage} of iteration {n} of run {layout.run_name!r} is committed but damaged, so it is not "
            f"reused: {exc}. {_audit(layout)}; {_redo(layout, n, stage)}",
        ) from exc
    return manifest


def adopt_commit_inputs(
    layout: RunLayout, n: int, *, stages: Sequence[str], handed: Mapping[str, str] | None = None
) -> list[Manifest]:
    """The stage manifests iteration n's commit names, checked: their content, the digests of the
    parents each names (the stage before it, the checkpoints the train stage wrote), and, when the
    flow passes them (`handed`: stage -> sha256), the digests the stages handed the flow as they ended.
    Their files were checked by whoever read or adopted them."""
    manifests = []
    checking = _Checking()
    for stage in stages:
        url = layout.stage_manifest(n, stage)
        try:
            manifest = _check_manifest(layout, url, checking, hash_files=False)
            checking.url = url
            if handed is not None and manifest.sha256 != handed[stage]:
                raise CorruptManifestError(
                    f"{url} has sha256 {manifest.sha256}, but the stage handed the flow {handed[stage]} when it "
                    "ended: it was replaced since"
                )
        except _DAMAGE as exc:
            raise DamagedOutputError(
                checking.url,
                f"cannot commit iteration {n} of run {layout.run_name!r}: stage {stage} does not check out: {exc}. "
                f"{_audit(layout)}; {_redo(layout, n, stage)}",
            ) from exc
        manifests.append(manifest)
    return manifests


def adopt_iteration_manifest(layout: RunLayout, n: int) -> Manifest:
    """Iteration n's manifest, written by a commit that died before LATEST moved, checked before that
    commit is finished: its content and the digests of every stage, checkpoint and previous
    iteration manifest it names."""
    checking = _Checking()
    checking.url = url = layout.iteration_manifest(n)
    try:
        manifest = read_manifest(layout, url)
        previous = manifest.data["previous"]
        refs = [*manifest.data["stages"].values(), *manifest.data["checkpoints"].values()]
        for ref in refs + ([] if previous is None else [previous]):
            checking.url = layout.url(ref["path"])
            verify_ref(layout, ref)
    except _DAMAGE as exc:
        raise DamagedOutputError(
            checking.url,
            f"iteration {n} of run {layout.run_name!r} was committed but LATEST not moved, and it does not check "
            f"out: {exc}. {_audit(layout)}",
        ) from exc
    return manifest
