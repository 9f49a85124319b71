"""Make megatron-core run on a CPU-only torch build.

megatron-core targets CUDA only: it calls `torch.cuda.current_device()`, the CUDA RNG and
`device="cuda"` in a few hundred places, and no config flag or environment variable turns that
off. This module is the one place where the project bends Megatron to the CPU, so that the
trainer, the converter and their tests run on a CPU CI machine. Each patch is a named function
whose docstring says which Megatron code it serves; `apply_cpu_compat()` applies them all.

Ordering: call `apply_cpu_compat()` after `parallel_state.initialize_model_parallel()` and before
`tensor_parallel.model_parallel_cuda_manual_seed()` (the seed call reads the "CUDA" RNG).
`tasks.megatron.parallel.init_parallel` does exactly that.

Two patches are not about the CPU and apply on every device; the trainer's `save_megatron` applies
them before each save: `patch_sync_save_queue` (a synchronous save needs no spawned process) and
`patch_deterministic_checkpoint_metadata` (a save writes no path, random id or varying order into
`.metadata`).

Scope and limits:
- No CPU patch is applied when `torch.cuda.is_available()`; on a GPU machine Megatron runs
  unmodified except for the save queue above.
- The device rewrite (`patch_cuda_tensor_creation`) is a `TorchFunctionMode`, and torch keeps its
  mode stack per thread. `apply_cpu_compat()` therefore enters the mode once in every thread that
  calls it; a thread that runs Megatron code must call it (or `init_parallel`) first. Every torch
  call of that thread then goes through the mode's Python hook, Megatron's or not: code with many
  small torch calls that never names CUDA runs inside `without_device_rewrite()` (the embedded
  engine's decoding: a 512 x 256 sampling call took 4.3-4.6 s under the mode, 3.7-3.9 s without).
- On CPU the "CUDA" RNG *is* the CPU default generator, so Megatron's forked RNG regions share
  state with plain torch code. Keep dropout at 0 (the trainer does).
- `use_distributed_optimizer=True` is not supported on CPU (distrib_optimizer.py checks for
  `torch.cuda.*Tensor` parameter types); use the plain Megatron optimizer.
"""

from __future__ import annotations

import inspect
import logging
import queue
import sys
import threading
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

__all__ = [
    "MADE_FOR",
    "apply_cpu_compat",
    "patch_current_device",
    "patch_cuda_rng",
    "patch_cuda_tensor_creation",
    "patch_clip_grads",
    "patch_deterministic_checkpoint_metadata",
    "patch_sync_save_queue",
    "without_device_rewrite",
]

# megatron-core versions these patches were written against and checked with.
MADE_FOR = ("0.16.1", "0.19.2")

_CLIP_NAME = "clip_grad_by_total_norm_fp32"


class _ThreadState(threading.local):
    """The device-rewrite mode entered in the current thread (torch's mode stack is per thread)."""

    mode: TorchFunctionMode | None = None


_applied: set[str] = set()
_per_thread = _ThreadState()
_lock = threading.Lock()


def _is_cuda_device(device: Any) -> bool:
    """True for anything that names a CUDA device: "cuda", "cuda:0", torch.device("cuda"), 0."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is a CUDA ordinal in torch's device arguments (bool is an int too; not a device).
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch call in this thread to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _megatron_version() -> str:
    from megatron.core import __version__

    return __version__


def _check_version() -> None:
    version = _megatron_version()
    if version not in MADE_FOR:
        warnings.warn(
            f"megatron-core {version} is not one of the versions the CPU patches were made for "
            f"{MADE_FOR}; if Megatron fails on a CUDA call, extend tasks/megatron/compat.py",
            stacklevel=3,
        )


def patch_current_device() -> None:
    """Point `torch.cuda.current_device()`, `current_stream()` and `synchronize()` at the CPU.

    Why: Megatron allocates with `device=torch.cuda.current_device()`, e.g.
    `models/common/embeddings/rotary_pos_embedding.py` (get_emb moves `inv_freq` there on the
    first forward, 0.16.1 line 162) and `utils.py` GlobalMemoryBuffer.get_tensor (line 631, used
    by `transformer/dot_product_attention.py` for the score buffer). On a CPU build the call
    raises "Torch not compiled with CUDA enabled". In 0.19.2,
    `distributed/param_and_grad_buffer.py` start_grad_sync (line 632) takes
    `torch.cuda.current_stream()` on every DDP gradient sync; torch's CPU stream stands in (it
    has `wait_event`/`wait_stream`). `synchronize()` is called by timers and checkpointing and
    has nothing to wait for on the CPU.
    """
    if "current_device" in _applied:
        return
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda *args, **kwargs: torch.cpu.current_stream()
    torch.cuda.synchronize = lambda *args, **kwargs: None
    _applied.add("current_device")


def patch_cuda_rng() -> None:
    """Back Megatron's "CUDA" RNG tracker with the CPU default generator.

    Why: `tensor_parallel/random.py` keeps named RNG states (model_parallel_cuda_manual_seed,
    CudaRNGStatesTracker.add/fork) through `torch.cuda.get_rng_state`,
    `torch.cuda.manual_seed` and its own `_set_cuda_rng_state`; `dot_product_attention.py`
    enters `get_cuda_rng_tracker().fork()` on every forward, even with dropout 0. All of these
    need a CUDA generator. `torch.cuda.manual_seed_all` becomes a no-op: `torch.manual_seed`
    calls it, so pointing it at the CPU seed would recurse.
    """
    if "cuda_rng" in _applied:
        return
    import megatron.core.tensor_parallel.random as mcore_random

    generator = torch.default_generator
    get_state = lambda *args, **kwargs: generator.get_state()  # noqa: E731
    torch.cuda.get_rng_state = get_state
    torch.cuda.random.get_rng_state = get_state
    torch.cuda.set_rng_state = lambda new_state, *args, **kwargs: generator.set_state(new_state)
    torch.cuda.manual_seed = lambda seed: generator.manual_seed(int(seed))
    torch.cuda.manual_seed_all = lambda seed: None
    mcore_random._set_cuda_rng_state = lambda new_state, *args, **kwargs: generator.set_state(new_state)
    _applied.add("cuda_rng")


def patch_cuda_tensor_creation() -> None:
    """Enter a TorchFunctionMode in this thread that turns `device="cuda"` into the CPU.

    Why: besides `current_device()`, Megatron writes the device literally, e.g.
    `transformer/utils.py` get_default_causal_mask (`torch.ones(..., device="cuda")`),
    `pipeline_parallel/schedules.py` forward_backward_no_pipelining (0.16.1 line 596,
    `torch.zeros([], dtype=torch.int, device="cuda")`), `optimizer/clip_grads.py` (the overflow
    buffer and norm tensors) and `.cuda()` calls in DDP and checkpointing. The mode rewrites
    the `device` argument, `Tensor.to("cuda")` and `Tensor.cuda()`. Torch keeps the mode stack
    per thread, so this is applied once per calling thread.
    """
    if _per_thread.mode is not None:
        return
    mode = _CudaToCpuMode()
    mode.__enter__()
    _per_thread.mode = mode
    logger.debug("entered the CUDA->CPU torch function mode in thread %s", threading.get_ident())


@contextmanager
def without_device_rewrite() -> Iterator[None]:
    """Run the block without this thread's CUDA->CPU torch function mode, if one was entered.

    For code that never names a CUDA device and makes many small torch calls (a decode loop):
    under the mode each call pays a Python hook. The mode must be the innermost one; another mode
    entered on top of it is refused rather than popped.
    """
    mode = _per_thread.mode
    if mode is None:
        yield
        return
    from torch.overrides import _get_current_function_mode

    current = _get_current_function_mode()
    if current is not mode:
        raise RuntimeError(f"the CUDA->CPU device rewrite is not the innermost torch function mode ({current!r} is)")
    mode.__exit__(None, None, None)
    try:
        yield
    finally:
        mode.__enter__()


def _clip_grad_by_total_norm_cpu(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    total_norm: float,
    use_decoupled_grad: bool = False,
) -> None:
    """Megatron's `clip_grad_by_total_norm_fp32` with the fp32 check made device-agnostic."""
    if use_decoupled_grad:
        raise NotImplementedError("decoupled gradients (the precision-aware optimizer) are not supported on CPU")
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [param.grad.detach() for param in parameters if param.grad is not None]
    bad = sorted({str(grad.dtype) for grad in grads if grad.dtype != torch.float32})
    if bad:
        raise TypeError(f"gradient clipping expects fp32 (main) gradients, got {bad}")
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def patch_clip_grads() -> None:
    """Make the Megatron optimizer's gradient clipping (clip_grad > 0) work on CPU tensors.

    Why: `optimizer/clip_grads.py` clip_grad_by_total_norm_fp32 asserts
    `param.grad.type() == 'torch.cuda.FloatTensor'` (0.16.1 line 167, 0.19.2 line 174), which a
    CPU gradient never satisfies. The replacement keeps the signature and the semantics (fp32
    check, in-place scale by max_norm / (total_norm + 1e-6) when that is below 1). It is bound in
    `clip_grads` and in every already-imported Megatron module that imported the name itself
    (`optimizer/optimizer.py`; 0.19.2 also `models/mimo/optimizer.py`). The norm
    (get_grad_norm_fp32) needs nothing beyond the device rewrite.
    """
    if "clip_grads" in _applied:
        return
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer  # noqa: F401  (imports the name being replaced)

    original = clip_grads.clip_grad_by_total_norm_fp32
    expected = ["parameters", "max_norm", "total_norm", "use_decoupled_grad"]
    found = list(inspect.signature(original).parameters)
    if found != expected:
        raise RuntimeError(
            f"megatron-core {_megatron_version()} changed clip_grad_by_total_norm_fp32's "
            f"signature to {found} (expected {expected}); update patch_clip_grads"
        )
    for name, module in list(sys.modules.items()):
        is_megatron = name.startswith("megatron.") and module is not None
        if is_megatron and vars(module).get(_CLIP_NAME) is original:
            setattr(module, _CLIP_NAME, _clip_grad_by_total_norm_cpu)
    _applied.add("clip_grads")


def _in_process_results_queue(mp_mode: str = "spawn") -> queue.Queue:
    """The results queue of a synchronous Megatron save: written and read by one process, so no
    multiprocessing context (`mp_mode`, 0.19.2's parameter) is needed."""
    return queue.Queue()


# The module function that makes the results queue, by megatron-core version (public since 0.19).
_RESULTS_QUEUE_FACTORY = {"0.16.1": "_get_write_results_queue", "0.19.2": "get_write_results_queue"}


def patch_sync_save_queue() -> None:
    """Give Megatron's synchronous checkpoint save an in-process results queue instead of a
    `multiprocessing.Manager` started with the "spawn" method. Applied on every device.

    Why: `dist_checkpointing/strategies/filesystem_async.py` creates
    `mp.get_context("spawn").Manager().Queue()` the first time a process saves
    (`_get_write_results_queue`, 0.16.1 line 51; `get_write_results_queue`, 0.19.2 line 53,
    called from `FileSystemWriterAsync.prepare_write_data`). A spawned manager is a fresh
    interpreter that re-imports the caller's `__main__` (the whole CLI: torch, Megatron, Prefect,
    MLflow): 6-7 s and about 370 MB resident on the CPU for every process that saves, kept until
    it exits. In a synchronous save (`dist_checkpointing.save` without `async_sharded_save`, the
    only kind the trainer makes) the queue is filled by `write_preloaded_data_multiproc` and read
    by `retrieve_write_results` in the same process, so a `queue.Queue` carries the same results;
    the per-bucket writers (forked processes in 0.16.1, threads in 0.19.2) still report through
    their own local queues. An asynchronous save would need the cross-process queue: do not
    apply this with `async_sharded_save=True`.
    """
    if "sync_save_queue" in _applied:
        return
    import megatron.core.dist_checkpointing.strategies.filesystem_async as fs_async

    version = _megatron_version()
    factory = _RESULTS_QUEUE_FACTORY.get(version)
    if factory is None or factory not in vars(fs_async):
        raise RuntimeError(
            f"megatron-core {version}: patch_sync_save_queue in tasks/megatron/compat.py knows the results "
            f"queue factory of {sorted(_RESULTS_QUEUE_FACTORY)} only; add this version's"
        )
    setattr(fs_async, factory, _in_process_results_queue)
    _applied.add("sync_save_queue")


# `dist_checkpointing.save(..., async_sharded_save=True)`'s writer, by megatron-core version.
_ASYNC_SAVE_OPTIONS: dict[str, dict[str, str]] = {"0.16.1": {}, "0.19.2": {"async_strategy": "mcore"}}


def async_save_options() -> dict[str, str]:
    """The keyword arguments that make `dist_checkpointing.save(..., async_sharded_save=True)` return
    Megatron's own asynchronous request (a preload function, a write function, finalisers) on
    every device. Not a patch: the choice of writer, pinned to its version.

    Why: 0.19.2 (`dist_checkpointing/serialization.py`, `save(..., async_strategy="nvrx")`) hands
    an asynchronous save to NVIDIA Resiliency Extension by default and raises ModuleNotFoundError
    without the `nvidia-resiliency-ext` package, which neither the CPU build nor the GPU image
    holds; `async_strategy="mcore"` keeps Megatron's own request (deprecated there in favour of
    NVRx, with one warning). 0.16.1 has only its own and no such argument.
    """
    version = _megatron_version()
    if version not in _ASYNC_SAVE_OPTIONS:
        raise RuntimeError(
            f"megatron-core {version}: async_save_options in tasks/megatron/compat.py knows "
            f"{sorted(_ASYNC_SAVE_OPTIONS)} only; add this version's"
        )
    return dict(_ASYNC_SAVE_OPTIONS[version])


def _anonymous_storage_meta(self: Any) -> Any:
    """What `.metadata` records of the writer that saved it: nothing (no path, no save id)."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    return StorageMeta()


def _write_result_key(result: Any) -> tuple[str, tuple[int, ...], int]:
    """Where a written item sits in the state dict: (key, chunk offset, index in a list)."""
    index = result.index
    return (index.fqn, () if index.offset is None else tuple(index.offset), -1 if index.index is None else index.index)


# megatron-core versions whose `FileSystemWriterAsync` writes torch's `storage_meta()` and the write
# results in the order its bucket writers report them into `.metadata`.
_METADATA_WRITTEN_BY = ("0.16.1", "0.19.2")


def patch_deterministic_checkpoint_metadata() -> None:
    """Make a distributed checkpoint's `.metadata` a function of the state saved, so two saves of
    one training state write the same bytes. Applied on every device.

    Why: `FileSystemWriterAsync.finish` (`dist_checkpointing/strategies/filesystem_async.py`; it
    defers to torch's `_FileSystemWriter.finish`) pickles into `.metadata`
    - `self.storage_meta()`: a `StorageMeta` holding the folder it saved to (a temporary folder named
      after the host and process, `storage/scratch.py`) and a fresh `uuid4()` save id. Neither is
      read back: loading takes the folder from its caller and sets its own `load_id`;
    - `storage_data`, a dict filled from the write results in the order the per-bucket writers
      reported them (forked processes in 0.16.1, threads in 0.19.2): the same entries, in an order
      that varies from save to save.
    Left as they are, they make `.metadata`, its checkpoint manifest and every manifest naming that
    one differ between two runs of one config. The patch gives `FileSystemWriterAsync` a
    `storage_meta` that records nothing and a `finish` that hands the results on sorted by where
    each item sits in the state dict. Checked with 0.16.1 (`tests/integration/test_megatron_save.py`)
    and against the upstream source after 0.19; it refuses another version, and one whose writer
    defines `storage_meta` itself.
    """
    if "deterministic_checkpoint_metadata" in _applied:
        return
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    version = _megatron_version()
    if version not in _METADATA_WRITTEN_BY or "storage_meta" in vars(FileSystemWriterAsync):
        raise RuntimeError(
            f"megatron-core {version}: patch_deterministic_checkpoint_metadata in tasks/megatron/compat.py was "
            f"checked with {_METADATA_WRITTEN_BY} only; check what this version's FileSystemWriterAsync "
            "writes into .metadata and add it"
        )
    finish = FileSystemWriterAsync.finish

    def finish_in_order(self: Any, metadata: Any, results: list[list[Any]]) -> None:
        finish(self, metadata, [sorted((r for rank in results for r in rank), key=_write_result_key)])

    FileSystemWriterAsync.storage_meta = _anonymous_storage_meta
    FileSystemWriterAsync.finish = finish_in_order
    _applied.add("deterministic_checkpoint_metadata")


def apply_cpu_compat() -> None:
    """Apply every CPU patch; idempotent, and a no-op when CUDA is available.

    Call after `initialize_model_parallel()` and before `model_parallel_cuda_manual_seed()`, and
    once in every thread that runs Megatron code (the device rewrite is per thread).
    """
    if torch.cuda.is_available():
        return
    with _lock:
        if not _applied:
            _check_version()
            logger.info("applying the CPU patches to megatron-core %s", _megatron_version())
        patch_current_device()
        patch_cuda_rng()
        patch_clip_grads()
    patch_cuda_tensor_creation()
