"""The run's MLflow run as the anchor of its audit trail: each manifest's digest, recorded as the
output is committed, outside the files the store holds.

A tag per manifest, `sdpo.anchor/<run-relative path>` = its sha256: run.json when the tracker first
opens the run, each stage's manifest as the stage hands it to the flow, each iteration's as its
commit returns, each evaluation's as it ends. Tags are one small write each, and a resume reads them
all in one request. `RunAnchor.open` checks the store against them before the run goes on
(`storage.anchored.adopt_recorded`) and registers them, so that every manifest this process reads is
checked too (`storage.anchor`); `sdpo verify` reads them (`flows.cli.audit`).

With tracking off there is nothing to record; a signing key (`SDPO_SIGNING_KEY`) still anchors every
manifest (`storage.anchor`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from storage import anchor

logger = logging.getLogger(__name__)

TAG = "sdpo.anchor/"


def recorded_in(tags: Mapping[str, str]) -> dict[str, str]:
    """The manifest digests an MLflow run's tags record, by run-relative path."""
    return {key[len(TAG) :]: value for key, value in tags.items() if key.startswith(TAG)}


class RunAnchor:
    """The digests a run's MLflow run holds, and the recording of new ones (no-ops with tracking off)."""

    def __init__(self, tracker: Any, layout: Any) -> None:
        self.tracker, self.layout = tracker, layout
        # pipelined commits record the train stage and the commit from a thread of the flow while
        # the flow records the next iteration's stages: one write to the tracking store at a time
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self.tracker.enabled)

    def open(self) -> None:
        """Check the run against its record before it goes on (a manifest that differs from its
        recorded digest is refused, an unrecorded stage beyond LATEST computed again), record what the
        check adds, and register the digests for every read of this process."""
        from storage.anchored import adopt_recorded

        if not self.enabled:
            return
        recorded = recorded_in(self.tracker.client.get_run(self.tracker.run_id).data.tags)
        if not recorded:
            logger.info("run %s: recording the digests of its manifests in its MLflow run", self.layout.run_name)
        keep = adopt_recorded(self.layout, recorded)
        self.tracker.set_tags({TAG + path: digest for path, digest in keep.items() if recorded.get(path) != digest})
        anchor.register(self.layout.run_url, keep)

    def record(self, ref: Mapping[str, Any]) -> None:
        """Record a committed manifest ({path, sha256}, as a stage hands it to the flow)."""
        if not self.enabled:
            return
        with self._lock:
            self.tracker.set_tags({TAG + ref["path"]: ref["sha256"]})
            anchor.remember(self.layout.run_url, ref["path"], ref["sha256"])

    def computing(self, path: str) -> None:
        """The manifest at `path` is absent and about to be computed again: its old digest no longer holds."""
        anchor.unrecord(self.layout.run_url, path)
