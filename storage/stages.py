"""One stage's output for one iteration: files, then a manifest written last.

stage = StageOutput(layout, n, "rollout")       # refuses a committed stage, clears a partial one
with ShardWriter(stage, ROLLOUT, top_k=16) as writer:
    writer.write(columns)
manifest = stage.commit(parents=[...], metrics={...})
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from storage.errors import AlreadyCommittedError, ChecksumMismatchError, NotCommittedError
from storage.faults import crash_point
from storage.hashing import sha256_bytes
from storage.layout import RunLayout, read_run
from storage.manifest import (
    Manifest,
    base_fields,
    is_wall_clock,
    plain_metrics,
    read_manifest,
    stage_done,
    verify_ref,
    write_manifest,
)

logger = logging.getLogger(__name__)


class StageOutput:
    """Collects the files of stage `stage` of iteration `n` and commits them with a manifest."""

    def __init__(self, layout: RunLayout, n: int, stage: str) -> None:
        self.layout = layout
        self.iteration = n
        self.stage = stage
        self.dir = layout.stage_dir(n, stage)
        if stage_done(layout, n, stage):
            raise AlreadyCommittedError(
                f"stage {stage} of iteration {n} is committed ({layout.stage_manifest(n, stage)}); "
                "committed outputs are never overwritten"
            )
        read_run(layout)  # the run must exist: manifests record its config hash
        leftovers = layout.store.list_files(self.dir)
        if leftovers:
            logger.warning(
                "stage %s of iteration %d has %d file(s) but no manifest (interrupted run); clearing %s",
                stage,
                n,
                len(leftovers),
                self.dir,
            )
            layout.store.remove_tree(self.dir)
        self._files: list[dict[str, Any]] = []
        self._schema: dict[str, Any] | None = None
        self._writer_open = False
        self._started = time.monotonic()
        self._committed = False

    # -- used by ShardWriter ----------------------------------------------------------------
    def _register_writer(self, schema_info: dict[str, Any]) -> None:
        if self._schema is not None:
            raise ValueError(f"stage {self.stage} of iteration {self.iteration} already has a shard writer")
        self._schema = schema_info
        self._writer_open = True

    def _writer_closed(self) -> None:
        self._writer_open = False

    def _add_file(self, entry: dict[str, Any]) -> None:
        if self._committed:
            raise AlreadyCommittedError(f"stage {self.stage} of iteration {self.iteration} is already committed")
        self._files.append(entry)

    # -- plain files ----------------------------------------------------------------------------
    def write_bytes(self, name: str, data: bytes) -> str:
        """Write a small non-shard file (e.g. train metrics) into the stage; returns its URL."""
        url = self.layout.stage_file(self.iteration, self.stage, name)
        self.layout.store.write_bytes(url, data)
        self._add_file(
            {"path": self.layout.relative(url), "bytes": len(data), "sha256": sha256_bytes(data), "rows": None}
        )
        return url

    def write_json(self, name: str, obj: Any) -> str:
        return self.write_bytes(name, (json.dumps(obj, indent=1, sort_keys=True, allow_nan=False) + "\n").encode())

    @property
    def files(self) -> list[dict[str, Any]]:
        return list(self._files)

    def commit(
        self,
        *,
        parents: Sequence[Manifest | Mapping[str, str]] = (),
        metrics: Mapping[str, Any] | None = None,
        timings: Mapping[str, float] | None = None,
    ) -> Manifest:
        """Write the stage manifest (files, sizes, digests, rows, schema, parents...) and return it."""
        if self._writer_open:
            raise ValueError(f"stage {self.stage} of iteration {self.iteration}: close the shard writer before commit")
        parent_refs = [p.ref if isinstance(p, Manifest) else dict(p) for p in parents]
        extends = self._schema["extends"] if self._schema is not None and "extends" in self._schema else None
        if extends is not None and extends not in parent_refs:
            raise ValueError(
                f"stage {self.stage} of iteration {self.iteration}: its shards extend the rows of "
                f"{self.layout.url(extends['path'])}; name that manifest among the parents"
            )
        for ref in parent_refs:
            verify_ref(self.layout, ref)
        rows = [f["rows"] for f in self._files if f["rows"] is not None]
        data = {
            **base_fields(self.layout, "stage"),
            "iteration": self.iteration,
            "stage": self.stage,
            "files": self._files,
            "rows": sum(rows),
            "bytes": sum(f["bytes"] for f in self._files),
            "schema": self._schema,
            "parents": parent_refs,
            "metrics": plain_metrics(metrics or {}),
            "timings": {"wall_s": round(time.monotonic() - self._started, 3), **plain_metrics(timings or {})},
        }
        crash_point(f"stage.files_written:{self.stage}", self.iteration)
        manifest = write_manifest(self.layout, self.layout.stage_manifest(self.iteration, self.stage), data)
        self._committed = True
        crash_point(f"stage.committed:{self.stage}", self.iteration)
        logger.info(
            "committed %s of iteration %d: %d file(s), %d rows, %d bytes (%s)",
            self.stage,
            self.iteration,
            len(self._files),
            data["rows"],
            data["bytes"],
            manifest.sha256[:12],
        )
        return manifest


def read_stage_file(layout: RunLayout, n: int, stage: str, name: str, *, verify: bool = True) -> bytes:
    """A committed stage's non-shard file, checked against the manifest's sha256."""
    manifest = read_manifest(layout, layout.stage_manifest(n, stage))
    url = layout.stage_file(n, stage, name)
    entry = next((f for f in manifest.data["files"] if f["path"] == layout.relative(url)), None)
    if entry is None:
        raise NotCommittedError(f"{url} is not listed in {manifest.path}")
    data = layout.store.read_bytes(url)
    if verify and (actual := sha256_bytes(data)) != entry["sha256"]:
        raise ChecksumMismatchError(url, expected=entry["sha256"], actual=actual)
    return data


def write_stage_manifest(
    layout: RunLayout,
    n: int,
    stage: str,
    *,
    parents: Sequence[Manifest | Mapping[str, str]] = (),
    metrics: Mapping[str, Any] | None = None,
    timings: Mapping[str, float] | None = None,
) -> Manifest:
    """Commit a stage whose outputs live elsewhere (e.g. train: its checkpoints, named in `parents`)."""
    return StageOutput(layout, n, stage).commit(parents=parents, metrics=metrics, timings=timings)


EVAL_FILE = "metrics.json"


def write_eval(layout: RunLayout, n: int, metrics: Mapping[str, Any], *, parents: Sequence[Manifest] = ()) -> Manifest:
    """Commit the evaluation of checkpoint n as stage `eval` of iteration n: its metrics in the manifest,
    and in `metrics.json` but for the wall-clock ones (so the file is the same in every run of a config)."""
    output = StageOutput(layout, n, "eval")
    output.write_json(EVAL_FILE, {k: v for k, v in plain_metrics(metrics).items() if not is_wall_clock(k)})
    return output.commit(parents=parents, metrics=metrics)


def read_eval(layout: RunLayout, n: int) -> dict[str, Any] | None:
    """The committed evaluation metrics of checkpoint n, or None when it was not evaluated yet."""
    if not stage_done(layout, n, "eval"):
        return None
    return dict(read_manifest(layout, layout.stage_manifest(n, "eval")).data["metrics"])
