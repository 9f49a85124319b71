"""The CLI's progress bar over a run's iterations: the iteration and stage under way, elapsed time, ETA.

It follows the store, not the flow: a thread reads LATEST and the next iteration's stage manifests
every couple of seconds, so it shows the same thing whichever process does the work. It is the one
progress display of a run: while it is shown no stage draws its own (`tasks.progress_bars`), and on
a console that is not a terminal it draws nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

POLL_SECONDS = 2.0
STAGE_ORDER = ("rollout", "teacher", "train")


def stage_under_way(layout: Any, latest: int, total: int) -> str:
    """What the run is doing: the first stage of iteration latest+1 without a manifest, or 'commit'/'done'."""
    from storage.manifest import stage_done

    if latest >= total:
        return "done"
    return next((s for s in STAGE_ORDER if not stage_done(layout, latest + 1, s)), "commit")


def describe(layout: Any, latest: int, total: int) -> str:
    stage = stage_under_way(layout, latest, total)
    if stage == "done":
        return f"{layout.run_name}: {total}/{total} iterations, evaluating and summarising"
    return f"{layout.run_name}: iteration {latest + 1}/{total} {stage}"


@contextlib.contextmanager
def iteration_progress(layout: Any, total: int, console: Any) -> Iterator[None]:
    """Show the bar on `console` while the body runs (log lines on the same console print above it);
    the stages' own bars stay off meanwhile, in this process and in those it starts."""
    import os

    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from storage.manifest import read_latest
    from tasks.progress_bars import RUN_PROGRESS_ENV

    stop = threading.Event()
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    # ETA from the iterations done in this session, however long one takes
    with Progress(*columns, console=console, transient=True, speed_estimate_period=24 * 3600) as bar:
        start = min(read_latest(layout) or 0, total)
        task = bar.add_task(describe(layout, start, total), total=total, completed=start)

        def poll() -> None:
            while not stop.wait(POLL_SECONDS):
                latest = min(read_latest(layout) or 0, total)
                bar.update(task, completed=latest, description=describe(layout, latest, total))

        thread = threading.Thread(target=poll, name="sdpo-progress", daemon=True)
        thread.start()
        before = os.environ.get(RUN_PROGRESS_ENV)
        os.environ[RUN_PROGRESS_ENV] = "1"
        try:
            yield
        finally:
            stop.set()
            thread.join()
            if before is None:
                os.environ.pop(RUN_PROGRESS_ENV)
            else:
                os.environ[RUN_PROGRESS_ENV] = before
