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


def test_stage_bars_stay_off_while_the_runs_bar_is_shown(monkeypatch):
    import io
    import os

    from rich.console import Console

    from flows.progress import iteration_progress
    from tasks.progress_bars import RUN_PROGRESS_ENV, bar_disabled

    monkeypatch.delenv(RUN_PROGRESS_ENV, raising=False)
    layout = RunLayout(f"memory://progress-{uuid.uuid4().hex}", "r")
    assert bar_disabled(False) is True and bar_disabled(True) is None  # None: tqdm draws on a terminal only
    with iteration_progress(layout, 3, Console(file=io.StringIO())):
        assert bar_disabled(True) is True
    assert bar_disabled(True) is None and RUN_PROGRESS_ENV not in os.environ
