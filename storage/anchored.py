"""A resumed run against the digests its tracking record holds: what it adopts, what it computes again.

The flow records each manifest's digest in the run's tracking record as the output is committed: a
stage's as the stage hands it to the flow, an iteration's as its commit returns
(`tasks/tracking/anchor.py`). Before a run goes on, `adopt_recorded` checks the store against them:

| found in the store | what happens |
|---|---|
| `run.json`, the iteration manifest `LATEST` names, a stage manifest of an iteration beyond it, the evaluation of `LATEST`'s iteration, with a digest other than the one recorded | refused: `DamagedOutputError` naming the first such file |
| a stage manifest of an iteration beyond `LATEST`, or `LATEST`'s evaluation, with no digest recorded (the run was killed between the stage's end and its record; or someone wrote it) | not adopted: removed, with the stages after it, and computed again (the same bytes: every stage is deterministic) |
| an iteration manifest with no digest recorded (a kill between the commit and its record) | recorded when it is what the commit writes from the recorded stages (their digests, the previous iteration's, the train stage's checkpoints, their metrics); refused otherwise |
| a recorded manifest that is missing beyond `LATEST` | forgotten: the output is computed again and recorded anew |
| nothing recorded yet (the run's first start with tracking, a fork, a run of an older version) | everything committed is recorded as it stands |

Only `run.json`, `LATEST`'s head and what lies beyond it are read here, so a resume costs the same
at iteration 1,000 as at 1; every other manifest is checked against its recorded digest when it is
read (`storage.manifest.check_anchors`), and all of them by `sdpo verify`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from storage.adopt import adopt_latest
from storage.checkpoints import checkpoints_named
from storage.departures import RUN_JSON, departures, iteration_of
from storage.errors import DamagedOutputError
from storage.hashing import sha256_bytes
from storage.layout import RunLayout
from storage.manifest import ITERATION_STAGES, Manifest, read_manifest

logger = logging.getLogger(__name__)

_STAGES = (*ITERATION_STAGES, "eval")


def committed_manifests(layout: RunLayout) -> dict[str, str]:
    """run.json and every iteration and stage manifest of the run, with the digests of their bytes as
    they stand: what a run's first recorded anchor holds (each is still checked when it is adopted)."""
    found = {RUN_JSON: sha256_bytes(layout.store.read_bytes(layout.run_json))}
    for n in layout.iterations():
        urls = [layout.iteration_manifest(n), *(layout.stage_manifest(n, stage) for stage in _STAGES)]
        for url in urls:
            if layout.store.exists(url):
                found[layout.relative(url)] = sha256_bytes(layout.store.read_bytes(url))
    return found


def _refuse(layout: RunLayout, url: str, what: str) -> DamagedOutputError:
    return DamagedOutputError(
        url,
        f"{url} {what}. The run does not go on from it: `sdpo verify {layout.run_name} --root {layout.root_url}` "
        "names every manifest that differs from the run's tracking record",
    )


def _check(layout: RunLayout, path: str, recorded: Mapping[str, str]) -> str:
    """The stored digest of the manifest (or run.json) at `path`, refused when it is not the one recorded."""
    url = layout.url(path)
    digest = sha256_bytes(layout.store.read_bytes(url))
    if path in recorded and recorded[path] != digest:
        raise _refuse(
            layout,
            url,
            f"has sha256 {digest}, but the run's tracking record holds {recorded[path]}, recorded when it was "
            "committed: it was changed since",
        )
    return digest


def _discard(layout: RunLayout, n: int, stage: str) -> None:
    """Remove an unrecorded stage and the stages of iteration n computed from it: they run again."""
    for later in _STAGES[_STAGES.index(stage) :]:
        folder = layout.stage_dir(n, later)
        if layout.store.list_files(folder):
            logger.warning(
                "run %s: %s holds no digest in the run's tracking record (killed before it was recorded, or "
                "written by someone else): computing it again",
                layout.run_name,
                folder,
            )
            layout.store.remove_tree(folder)


def _written_by_the_commit(layout: RunLayout, manifest: Manifest, recorded: Mapping[str, str], n: int) -> bool:
    """Whether iteration n's manifest is what the commit writes from the recorded stages: the stages'
    recorded digests, the previous iteration's, the train stage's checkpoints, the stages' metrics."""
    data = manifest.data
    stages = data.get("stages", {})
    if sorted(stages) != sorted(ITERATION_STAGES):
        return False
    if any(recorded.get(ref["path"]) != ref["sha256"] for ref in stages.values()):
        return False
    previous = data.get("previous")
    if previous is not None and recorded.get(previous["path"]) != previous["sha256"]:
        return False
    if previous is None and any(path.endswith("/_manifest.json") and path.count("/") == 1 for path in recorded):
        return False  # only the run's first commit names no previous iteration
    named = checkpoints_named(layout, read_manifest(layout, layout.url(stages["train"]["path"])), n)
    if any(named.get(kind) != ref for kind, ref in data.get("checkpoints", {}).items()):
        return False
    metrics: dict[str, Any] = {}
    for ref in stages.values():
        metrics.update(read_manifest(layout, layout.url(ref["path"])).data.get("metrics", {}))
    return bool(data.get("metrics") == {k: float(v) for k, v in metrics.items()} and data.get("iteration") == n)


def adopt_recorded(layout: RunLayout, recorded: Mapping[str, str]) -> dict[str, str]:
    """Check the run against the digests its tracking record holds (see the module doc) before it
    goes on; remove what it must compute again. Returns the digests to record now (and the recorded
    ones it keeps); DamagedOutputError naming the first manifest that departs from the record (an
    edit of a committed stage shows first in the iteration manifests that cover it: the stage is named)."""
    if not recorded:
        return committed_manifests(layout)
    try:
        return _adopt(layout, recorded)
    except DamagedOutputError as exc:
        first = departures(layout, recorded)
        if first and first[0][0] != exc.url:
            raise _refuse(layout, *first[0]) from exc
        raise


def _adopt(layout: RunLayout, recorded: Mapping[str, str]) -> dict[str, str]:
    latest = adopt_latest(layout) or 0
    keep = {path: digest for path, digest in recorded.items() if iteration_of(path) <= latest}
    keep[RUN_JSON] = _check(layout, RUN_JSON, recorded)
    for n in [latest, *(m for m in layout.iterations() if m > latest)]:
        url = layout.iteration_manifest(n)
        path = layout.relative(url)
        if n > 0 and layout.store.exists(url):
            if path in recorded:
                keep[path] = _check(layout, path, recorded)
            else:
                manifest = read_manifest(layout, url)
                if not _written_by_the_commit(layout, manifest, recorded, n):
                    raise _refuse(
                        layout,
                        url,
                        "holds no digest in the run's tracking record and is not what the commit "
                        "writes from the recorded stages",
                    )
                keep[path] = manifest.sha256
        for stage in _STAGES if n > latest else ("eval",):
            url = layout.stage_manifest(n, stage)
            path = layout.relative(url)
            if not layout.store.exists(url):
                keep.pop(path, None)  # computed again, and recorded anew
            elif path in recorded:
                keep[path] = _check(layout, path, recorded)
            else:
                _discard(layout, n, stage)
                for later in _STAGES[_STAGES.index(stage) :]:
                    keep.pop(layout.relative(layout.stage_manifest(n, later)), None)
                break
    return keep
