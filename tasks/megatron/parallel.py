"""Process-group set-up for Megatron-core: torch.distributed, model parallelism, RNG seeds.

Works the same under `torchrun` (the env:// rendezvous torchrun provides) and in a plain
process (a world of one, with an in-memory store, so no port is needed). It may be called
repeatedly in one process: a long-lived flow process trains iteration after iteration, and
tests build several models. Matching sizes are reused; different sizes rebuild the model-parallel
groups on the existing world.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = ["ParallelLayout", "init_parallel", "destroy_parallel"]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class ParallelLayout:
    """Where this process sits: world rank, tensor-parallel rank, data-parallel rank."""

    rank: int
    world_size: int
    tp_rank: int
    tensor_parallel: int
    dp_rank: int
    data_parallel: int


def _init_process_group() -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if all(var in os.environ for var in _TORCHRUN_VARS):
        dist.init_process_group(backend=backend)
    else:
        # Not launched by torchrun: a world of one. An in-memory store avoids picking a port,
        # which could race with other processes on a shared machine.
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    logger.info(
        "torch.distributed up: backend=%s rank=%d world_size=%d",
        backend,
        dist.get_rank(),
        dist.get_world_size(),
    )


def _current_layout() -> ParallelLayout:
    from megatron.core import parallel_state

    return ParallelLayout(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tensor_parallel=parallel_state.get_tensor_model_parallel_world_size(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        data_parallel=parallel_state.get_data_parallel_world_size(),
    )


def init_parallel(*, tensor_parallel: int = 1, seed: int) -> ParallelLayout:
    """Initialise torch.distributed and Megatron model parallelism, and seed Megatron's RNGs.

    Data parallelism takes the rest of the world (world_size / tensor_parallel). On a CPU-only
    torch the Megatron CPU patches are applied (in the calling thread too) between
    `initialize_model_parallel` and `model_parallel_cuda_manual_seed`, as they must be.
    Seeds are re-applied on every call, so a repeated call gives a reproducible state.
    """
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as mcore_tp

    from tasks.megatron.compat import apply_cpu_compat

    if not dist.is_initialized():
        _init_process_group()
    world_size = dist.get_world_size()
    if tensor_parallel < 1 or world_size % tensor_parallel:
        raise ValueError(f"tensor_parallel={tensor_parallel} does not divide world_size={world_size}")
    if parallel_state.model_parallel_is_initialized():
        current = parallel_state.get_tensor_model_parallel_world_size()
        if current != tensor_parallel:
            logger.info("rebuilding model-parallel groups: tp %d -> %d", current, tensor_parallel)
            parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=1
        )
    apply_cpu_compat()
    torch.manual_seed(seed)
    mcore_tp.model_parallel_cuda_manual_seed(seed)
    return _current_layout()


def destroy_parallel() -> None:
    """Tear down Megatron's groups and the process group (safe to call when not initialised).

    The ranks meet at a barrier first, so none tears its groups down while another still uses them.
    A process that exits with a gloo group still up can abort in the group's destructor
    ("terminate called without an active exception"), so a torchrun rank calls this before it ends.
    """
    from megatron.core import parallel_state

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
