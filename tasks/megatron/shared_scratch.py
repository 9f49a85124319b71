"""Scratch folders that every rank of a training job writes into, on a file system they share.

Rank 0 makes the folder and tells the others its path; each rank leaves a marker once its shards
are written, so rank 0 can tell a folder the ranks really share from per-node folders of the same
name (torchrun over several nodes with a node-local `storage.cache_dir`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["check_shared", "mark_shared", "shared_scratch"]


@contextlib.contextmanager
def shared_scratch(cache_dir: str, rank: int, *, prefix: str = "ckpt") -> Iterator[Path]:
    """A scratch folder every rank writes into: rank 0 makes it, the others are told its path."""
    import torch.distributed as dist

    from storage.scratch import scratch_dir

    holder: list[Any] = [None]
    with contextlib.ExitStack() as stack:
        if rank == 0:
            holder[0] = str(stack.enter_context(scratch_dir(cache_dir, prefix)))
        dist.broadcast_object_list(holder, src=0)
        yield Path(holder[0])
        dist.barrier()  # nobody is still writing when rank 0 removes it


def mark_shared(folder: Path, rank: int, world: int) -> None:
    """This rank's marker in `folder` once its shards are written there (several ranks only)."""
    import torch.distributed as dist

    if world > 1:
        (folder / f".rank-{rank}").touch()
        dist.barrier()


def check_shared(folder: Path, world: int) -> None:
    """Every rank left its marker in `folder`: the ranks share the file system the checkpoint needs."""
    missing = [r for r in range(world) if not (folder / f".rank-{r}").exists()]
    if missing:
        raise RuntimeError(
            f"ranks {missing} wrote their checkpoint shards somewhere rank 0 cannot see ({folder}): with "
            "torchrun over several nodes, storage.cache_dir must be on a file system all nodes share"
        )
