"""The trainer's state across iterations and processes: kept in the process that trained the
previous iteration, otherwise rebuilt from the store (the last full state plus a checked replay)."""

from __future__ import annotations

import logging
from typing import Any

from tasks.megatron.trainer import MegatronTrainer
from tasks.runtime import Run

logger = logging.getLogger(__name__)

# the trainer of each run this process trained last, by run URL
_TRAINERS: dict[str, MegatronTrainer] = {}


def full_state_iteration(run: Run, iteration: int) -> int:
    """The last iteration <= `iteration` with a committed full training state (0: the base model)."""
    from storage.checkpoints import checkpoint_exists
    from storage.manifest import stage_done
    from storage.retention import is_pruned

    for m in range(iteration, 0, -1):
        committed = stage_done(run.layout, m, "train") and checkpoint_exists(run.layout, m, "megatron")
        if committed and not is_pruned(run.layout, m, "megatron"):
            return m
    return 0


def restore_trainer(run: Run, iteration: int) -> MegatronTrainer:
    """A trainer in exactly the state it had after `iteration`, rebuilt from the store.

    The last full state (Megatron checkpoint) at or before `iteration` is loaded, and the
    iterations after it are replayed from their committed teacher shards (training is a function
    of the state, the shards and the seed); each replayed iteration is checked against the policy
    checkpoint it committed.
    """
    from storage.shard_reader import read_stage_columns
    from tasks.megatron.batches import TRAIN_COLUMNS
    from tasks.runtime import checkpoint_dir

    start = full_state_iteration(run, iteration)
    # The base model gives the architecture (and the weights when start = 0); retention never prunes it.
    trainer = MegatronTrainer(run.cfg, checkpoint_dir(run, 0, "policy"))
    if start > 0:
        trainer.load_megatron(checkpoint_dir(run, start, "megatron"))
    for m in range(start + 1, iteration + 1):
        logger.info(
            "replaying the training of iteration %d from its teacher shards (full state of iteration %d)", m, start
        )
        columns = read_stage_columns(
            run.layout, m, "teacher", columns=TRAIN_COLUMNS, verify=run.cfg.storage.verify_sha256
        )
        trainer.train_iteration(columns, iteration=m)
        check_replay(run, trainer, m)
    trainer.iteration = iteration
    from storage.checkpoints import checkpoint_exists

    if full_state_due(run, iteration) and not checkpoint_exists(run.layout, iteration, "megatron"):
        # a background save that a killed process did not finish: saved again, from the same state
        logger.info("saving the full state of iteration %d again: the save in flight was interrupted", iteration)
        start_full_state_save(trainer, run.cfg.storage.cache_dir, iteration=iteration)
    return trainer


def full_state_due(run: Run, iteration: int) -> bool:
    """Whether `iteration` saves its full state before the run's last iteration: in the background,
    uploaded by the next train stage (the last one saves it in its own stage)."""
    return 0 < iteration < run.cfg.iterations and iteration % run.cfg.train.megatron_checkpoint_every == 0


def start_full_state_save(trainer: MegatronTrainer, cache_dir: str, *, iteration: int) -> None:
    """Start the background save of the trainer's full state after `iteration` into a scratch folder
    of its own, kept until the save is uploaded (collective; `tasks.megatron.full_state`)."""
    import contextlib

    import torch.distributed as dist

    from tasks.megatron.shared_scratch import mark_shared, shared_scratch

    rank, world = dist.get_rank(), dist.get_world_size()
    stack = contextlib.ExitStack()
    scratch = stack.enter_context(shared_scratch(cache_dir, rank, prefix="fullstate"))
    trainer.start_megatron_save(scratch / "megatron", iteration=iteration, release=stack.close)
    mark_shared(scratch, rank, world)


def upload_full_state(run: Run, saved: Any) -> Any:
    """Upload a completed background save (`tasks.megatron.full_state.PendingFullState`) as the
    megatron checkpoint of its iteration, whose policy and teacher shards are committed (rank 0);
    its checkpoint manifest."""
    import torch.distributed as dist

    from storage.checkpoints import resolve_checkpoint, upload_checkpoint
    from storage.manifest import read_stage_manifest
    from tasks.megatron.shared_scratch import check_shared

    if dist.get_world_size() > 1:
        check_shared(saved.folder.parent, dist.get_world_size())
    return upload_checkpoint(
        saved.folder,
        run.layout,
        saved.iteration,
        "megatron",
        parent=resolve_checkpoint(run.layout, f"iter-{saved.iteration}", "policy"),
        trained_on=[read_stage_manifest(run.layout, saved.iteration, "teacher")],
        handed_over=run.cfg.storage.link_uploads,
    )


def check_replay(run: Run, trainer: MegatronTrainer, iteration: int) -> None:
    """Fail when replaying `iteration` did not reproduce the policy weights it committed."""
    import torch

    from storage.checkpoints import read_checkpoint_manifest, resolve_checkpoint
    from storage.hashing import sha256_local_file
    from storage.scratch import scratch_dir
    from tasks.kept_weights import WEIGHTS_FILE
    from tasks.tokenizers import stored_tokenizer

    stored = {e["name"]: e["sha256"] for e in read_checkpoint_manifest(run.layout, iteration, "policy").data["files"]}
    storage = run.cfg.storage
    with scratch_dir(storage.cache_dir, "replay") as tmp:
        base_manifest = resolve_checkpoint(run.layout, 0, "policy")
        base = stored_tokenizer(run.layout, base_manifest, cache_dir=storage.cache_dir, verify=storage.verify_sha256)
        trainer.save_hf(tmp, base)  # collective; rank 0 writes
        if torch.distributed.get_rank() != 0:
            return
        replayed = sha256_local_file(tmp / WEIGHTS_FILE)
    if replayed != stored[WEIGHTS_FILE]:
        raise RuntimeError(
            f"replaying iteration {iteration} of run {run.layout.run_name!r} gave weights {replayed[:12]}, but its "
            f"committed policy has {stored[WEIGHTS_FILE][:12]}: training is not deterministic here "
            f"(train.deterministic={run.cfg.train.deterministic}), so an exact resume needs "
            "train.deterministic=true or train.megatron_checkpoint_every=1"
        )


def get_trainer(run: Run, iteration: int) -> MegatronTrainer:
    """A trainer holding the state after iteration-1: this process's own when it trained that
    iteration, else restored from the store (`restore_trainer`); both are the same state."""
    from tasks.megatron.parallel import init_parallel

    trainer = _TRAINERS.get(run.url)
    if trainer is not None and trainer.iteration == iteration - 1:
        # The CPU compatibility patches are per thread; a stage may run on a new worker thread.
        init_parallel(tensor_parallel=run.cfg.train.tensor_parallel, seed=run.cfg.seed)
        return trainer
    _TRAINERS.pop(run.url, None)
    trainer = restore_trainer(run, iteration - 1)
    _TRAINERS[run.url] = trainer
    return trainer
