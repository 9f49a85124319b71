"""Whether a stage draws a library progress bar (tqdm: `rollout:`, `teacher`, `warm-up:`).

One progress display at a time: `sdpo run` shows its own bar over the iterations
(`flows.progress`) and marks it in the environment, which the stage processes and the worker that
samples ahead inherit; while it is shown, or when the bar's stream (stderr) is not a terminal (a
pipe, a log file, a Prefect worker's log), no stage draws one. `sdpo stage` or `sdpo eval` run in a
terminal still show theirs.
"""

from __future__ import annotations

import os

RUN_PROGRESS_ENV = "SDPO_RUN_PROGRESS"  # set while `sdpo run`'s own progress bar is shown


def bar_disabled(progress: bool) -> bool | None:
    """tqdm's `disable` for a bar a caller asks for with `progress`: True when not asked for or while
    the run's own bar is shown; else None, with which tqdm draws only on a terminal."""
    if not progress or os.environ.get(RUN_PROGRESS_ENV):
        return True
    return None
