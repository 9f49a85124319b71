"""The manifests of a run in the order it committed them, and those that depart from their anchors.

`departures` walks run.json and then each iteration's stages, checkpoints, commit and evaluation, in
the order the run wrote them, and lists every manifest whose digest is not the one the run's
tracking record holds, that the record names but the store lacks, that the store holds but the
record does not, or (with the signing key) whose signature does not check out: the first of them
is the first edited. `sdpo verify`, a resume (`storage.anchored`) and the check of LATEST
(`storage.adopt`) name it.
"""

from __future__ import annotations

from collections.abc import Mapping

from storage.hashing import sha256_bytes
from storage.layout import RunLayout
from storage.manifest import read_manifest

__all__ = ["RUN_JSON", "departures", "iteration_of"]

RUN_JSON = "run.json"


def iteration_of(path: str) -> int:
    """The iteration a run-relative manifest path belongs to (iter-<n>/...); -1 for run.json."""
    head = path.split("/", 1)[0]
    return int(head[len("iter-") :]) if head.startswith("iter-") and head[len("iter-") :].isdigit() else -1


def _commit_order(layout: RunLayout, n: int) -> list[str]:
    """Iteration n's manifests in the order the run commits them: its stages, the checkpoints the train
    stage writes, the train stage, the iteration, its evaluation."""
    urls = [layout.stage_manifest(n, "rollout"), layout.stage_manifest(n, "teacher")]
    urls += [layout.checkpoint_manifest(n, kind) for kind in ("policy", "teacher", "megatron")]
    urls += [layout.stage_manifest(n, "train"), layout.iteration_manifest(n), layout.stage_manifest(n, "eval")]
    return [layout.relative(url) for url in urls]


def departures(layout: RunLayout, recorded: Mapping[str, str] | None) -> list[tuple[str, str]]:
    """(URL, what) for every manifest that departs from its anchors, in the order the run committed
    them (by iteration: its stages and checkpoints, its commit, its evaluation), so the first is the
    first edited: a digest other than the one the tracking record holds (`recorded`), a recorded
    manifest missing, a committed one the record does not hold (beyond a run killed between a commit
    and its record, which the next resume checks and records); with the signing key, a signature
    that does not check out."""
    from storage.anchor import signing_key
    from storage.errors import StorageError
    from storage.manifest import check_anchors, read_latest

    latest = read_latest(layout) or 0
    recorded = dict(recorded or {})
    iterations = sorted({*layout.iterations(), *layout.checkpoint_iterations(), *map(iteration_of, recorded)} - {-1})
    out = []
    for path in [RUN_JSON, *(p for n in iterations for p in _commit_order(layout, n))]:
        url, n = layout.url(path), iteration_of(path)
        present = layout.store.exists(url)
        if path in recorded and not present:
            if n <= latest:  # beyond LATEST: not committed yet, computed again
                out.append((url, f"is missing; the run's tracking record holds its digest {recorded[path][:12]}"))
            continue
        if not present:
            continue
        digest = sha256_bytes(layout.store.read_bytes(url))
        if path in recorded and recorded[path] != digest:
            out.append(
                (
                    url,
                    f"has sha256 {digest[:12]}, the run's tracking record {recorded[path][:12]}, recorded when it was committed",
                )
            )
        elif recorded and path not in recorded and 0 < n <= latest and not path.startswith("checkpoints/"):
            out.append((url, "is committed, but the run's tracking record holds no digest for it"))
        elif signing_key() is not None and path != RUN_JSON:
            try:
                check_anchors(layout, read_manifest(layout, url))
            except StorageError as exc:
                out.append((url, str(exc).removeprefix(url).lstrip(": ")))
    return out
