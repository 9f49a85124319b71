"""Named crash points, for the fault-injection tests and for anyone auditing the restart guarantees.

The pipeline calls `crash_point(name, iteration)` at every stage boundary and inside each write
path. Normally that is one environment lookup. With `SDPO_CRASH_AT=<name>@<iteration>` (or just
`<name>` for every iteration) set, reaching that point kills the whole process group with SIGKILL,
as a power cut or an OOM kill would: no `finally`, no atexit, no flush. The restart tests run a
real `sdpo run` with each point armed, then run the same command again and compare the result with
an uninterrupted run. `CRASH_POINTS` lists every point, in the order one iteration reaches them.

`SDPO_PAUSE_AT` (same syntax) makes the process stop at the point instead, sleeping until it is
killed, as a hung stage would (a stuck read, a collective whose peer is gone): the tests of stage
timeouts and of killed runs use it. With `SDPO_PAUSE_UNTIL=<path>` as well, the process goes on once
that file exists, as a long stage would: a test holds a stage running while it kills or restarts
what is around it, then lets the stage finish.
"""

from __future__ import annotations

import logging
import os
import signal
import time

logger = logging.getLogger(__name__)

CRASH_ENV = "SDPO_CRASH_AT"
PAUSE_ENV = "SDPO_PAUSE_AT"
RESUME_ENV = "SDPO_PAUSE_UNTIL"

CRASH_POINTS = (
    "stage.start:rollout",
    "stage.files_written:rollout",  # shards written, manifest not yet
    "rollout.awaiting_parent_commit",  # sampled from weights handed over: the previous commit still in flight
    "stage.committed:rollout",  # manifest written, task not yet returned
    "stage.start:teacher",
    "stage.files_written:teacher",
    "teacher.awaiting_parent_commit",  # scored with a teacher handed over: the previous commit still in flight
    "stage.committed:teacher",
    "stage.start:train",
    "train.trained",  # optimizer steps done, nothing saved
    "train.handed_over",  # the weights handed to the next iteration's stages, nothing stored yet
    "checkpoint.uploading:policy",  # some files of the policy checkpoint uploaded
    "checkpoint.committed:policy",  # policy checkpoint manifest written, train manifest not yet
    "checkpoint.uploading:teacher",
    "checkpoint.committed:teacher",
    "checkpoint.saving:megatron",  # inside the distributed-checkpoint save (local temp folder)
    "stage.files_written:train",
    "stage.committed:train",
    # the full state: uploaded by the stage that saved it (the last iteration, a process that ends
    # there), or, saved in the background, by the next iteration's train stage
    "checkpoint.uploading:megatron",
    "checkpoint.committed:megatron",
    "commit.start",
    "commit.manifest_written",  # iteration manifest written, LATEST not yet moved
    "commit.latest_moved",
    "stage.start:eval",
    "stage.files_written:eval",
    "stage.committed:eval",
    "tracking.logged",  # the step's metrics are in MLflow
    # iteration 0 of a test-time run (tasks/test_time.py)
    "stage.start:baseline",
    "stage.files_written:baseline",
    "stage.committed:baseline",
    "stage.start:discovery",
    "stage.files_written:discovery",
    "stage.committed:discovery",
)
TEST_TIME_CRASH_POINTS = tuple(p for p in CRASH_POINTS if p.endswith((":baseline", ":discovery")))


def _armed(env: str, name: str, iteration: int | None) -> bool:
    spec = os.environ.get(env)
    if not spec:
        return False
    point, _, at = spec.partition("@")
    return point == name and (not at or (iteration is not None and int(at) == iteration))


def crash_point(name: str, iteration: int | None = None) -> None:
    """SIGKILL this process group here when `SDPO_CRASH_AT` names this point (and iteration); sleep
    here until killed when `SDPO_PAUSE_AT` does."""
    if name not in CRASH_POINTS:
        raise ValueError(f"crash point {name!r} is not in storage.faults.CRASH_POINTS")
    if _armed(CRASH_ENV, name, iteration):
        logger.warning("crash point %s (iteration %s) reached: killing process group", name, iteration)
        os.killpg(os.getpgid(0), signal.SIGKILL)
    if _armed(PAUSE_ENV, name, iteration):
        resume = os.environ.get(RESUME_ENV)
        if not resume:
            logger.warning("pause point %s (iteration %s) reached: sleeping until killed", name, iteration)
            while True:
                time.sleep(3600)
        logger.warning("pause point %s (iteration %s) reached: sleeping until %s exists", name, iteration, resume)
        while not os.path.exists(resume):
            time.sleep(0.2)
