"""The CLI progress bar's description follows the store: iteration and stage under way."""

from __future__ import annotations

import uuid

from flows.progress import describe
from storage.layout import RunLayout


def test_the_bar_names_the_first_stage_without_a_manifest():
    layout = RunLayout(f"memory://progress-{uuid.uuid4().hex}", "r")
    assert describe(layout, 1, 3) == "r: iteration 2/3 rollout"
    layout.store.write_bytes(layout.stage_manifest(2, "rollout"), b"{}")
    assert describe(layout, 1, 3) == "r: iteration 2/3 teacher"
    for stage in ("teacher", "train"):
        layout.store.write_bytes(layout.stage_manifest(2, stage), b"{}")
    assert describe(layout, 1, 3) == "r: iteration 2/3 commit"
    assert describe(layout, 3, 3) == "r: 3/3 iterations, evaluating and summarising"
