"""The full training state saved beside training: staged to host memory, written by a thread.

A Megatron distributed checkpoint of a 0.6B model (weights, float32 master copies, Adam's moments)
is about 8 GB; written and hashed on the train stage's path it held an iteration up for tens of
seconds. Saved in the background instead:

1. `start` (every rank, on the training thread): Megatron plans the save and writes its common
   part (`dist_checkpointing.save(..., async_sharded_save=True)`), then the request's preload copies
   every tensor shard to host memory. From then on the model and optimizer may step again.
2. A thread of this process writes the staged shards (the request's own write function).
3. `finish` (every rank, on the training thread of a later train stage: the next one): waits for
   the thread, then runs the request's finalisation, which is collective (the global `.metadata`,
   the checkpoint's config and a barrier), and writes the trainer's scheduler state and cursor.
   The caller uploads the folder and names the checkpoint in that stage's manifest, so the commit
   that names the state waited for it.

A process killed before `finish` leaves a folder without a manifest: nothing reads it, and the
next train stage after a restart replays the iteration from its stored shards and saves it again
(`tasks.megatron.resume`). The RNG state is not saved: every iteration seeds it from (seed,
iteration, data-parallel rank), see `tasks.megatron.trainer.seed_training_rng`.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.megatron.side_stream import side_stream

logger = logging.getLogger(__name__)

__all__ = ["PendingFullState", "finish", "save_now", "start", "write_trainer_state"]


@dataclass
class PendingFullState:
    """A full-state save of `iteration` whose shards a thread is writing into `folder`."""

    folder: Path
    iteration: int
    thread: threading.Thread
    finalize_fns: list[Callable[[], None]]
    scheduler_state: dict[str, Any]
    errors: list[BaseException] = field(default_factory=list)
    release: Callable[[], None] = lambda: None  # frees `folder` once uploaded (its scratch space)


def _sharded_state(model: Any, optimizer: Any) -> dict[str, Any]:
    state = model.sharded_state_dict(prefix="model.")
    state["optimizer"] = optimizer.sharded_state_dict(state)
    return state


def write_trainer_state(folder: Path, *, scheduler_state: dict[str, Any], iteration: int) -> None:
    """The scheduler's state and the cursor beside the shards (rank 0; the same on every rank)."""
    import torch

    if torch.distributed.get_rank() == 0:
        torch.save({"scheduler": scheduler_state, "iteration": iteration}, folder / "trainer_state.pt")
        (folder / "cursor.json").write_text(json.dumps({"iteration": iteration}))


def _prepare() -> None:
    from tasks.megatron.compat import patch_deterministic_checkpoint_metadata, patch_sync_save_queue

    patch_sync_save_queue()
    patch_deterministic_checkpoint_metadata()


def save_now(model: Any, optimizer: Any, scheduler: Any, folder: Path, *, iteration: int) -> None:
    """The full state after `iteration` written into `folder` before returning (collective)."""
    from megatron.core import dist_checkpointing

    from storage.faults import crash_point

    _prepare()
    folder.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(_sharded_state(model, optimizer), str(folder))
    crash_point("checkpoint.saving:megatron", iteration)
    write_trainer_state(folder, scheduler_state=scheduler.state_dict(), iteration=iteration)


def start(model: Any, optimizer: Any, scheduler: Any, folder: Path, *, iteration: int) -> PendingFullState:
    """Stage the full state after `iteration` in host memory and start writing it into `folder` on
    a thread (collective: every rank calls it). The model may step once this returns."""
    from megatron.core import dist_checkpointing

    from storage.faults import crash_point

    _prepare()
    folder.mkdir(parents=True, exist_ok=True)
    from tasks.megatron.compat import async_save_options

    request = dist_checkpointing.save(
        _sharded_state(model, optimizer), str(folder), async_sharded_save=True, **async_save_options()
    )
    args = list(request.async_fn_args)
    if request.preload_fn is not None:  # args[1]: the write buckets, staged to host memory here
        with side_stream(next(model.parameters()).device):  # beside a decode, off its stream
            args[1] = request.preload_fn()
    pending = PendingFullState(
        folder=folder,
        iteration=iteration,
        thread=threading.Thread(),  # replaced below, once the target can reach `pending`
        finalize_fns=list(request.finalize_fns),
        scheduler_state=copy.deepcopy(scheduler.state_dict()),  # the scheduler steps on
    )

    def write() -> None:
        if request.async_fn is None:
            return
        try:
            request.async_fn(*args, **request.async_fn_kwargs)
        except BaseException as error:  # noqa: BLE001 -- handed to `finish`, which raises it on the training thread
            pending.errors.append(error)

    pending.thread = threading.Thread(target=write, name=f"full-state-{iteration}", daemon=True)
    pending.thread.start()
    crash_point("checkpoint.saving:megatron", iteration)
    logger.info("full state of iteration %d staged; writing it into %s in the background", iteration, folder)
    return pending


def finish(pending: PendingFullState) -> Path:
    """Wait for the background write, finalise the checkpoint (collective) and write the trainer's
    state; returns the complete folder. Raises what stopped the write."""
    pending.thread.join()
    if pending.errors:
        raise RuntimeError(
            f"writing the full state of iteration {pending.iteration} into {pending.folder} failed"
        ) from pending.errors[0]
    for finalize in pending.finalize_fns:
        finalize()
    write_trainer_state(pending.folder, scheduler_state=pending.scheduler_state, iteration=pending.iteration)
    return pending.folder
