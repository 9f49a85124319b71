"""Training stage: trains iteration n on its teacher shards and stores what it produced.

Its outputs are the policy checkpoint (HF safetensors for the engines), the EMA teacher when the
teacher mode keeps one, the Megatron full state every `train.megatron_checkpoint_every` iterations,
and the stage manifest naming them, written last. The trainer itself is `tasks/megatron/trainer.py`.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tasks import handover
from tasks.kept_weights import WEIGHTS_FILE
from tasks.runtime import Run

logger = logging.getLogger(__name__)


def update_teacher(run: Run, iteration: int, *, student: dict[str, Any]) -> dict[str, Any] | None:
    """The EMA teacher of `iteration`, float32 on the device of `student` (the policy's weights just
    trained, under HF names); None when the mode keeps no teacher copy."""
    if run.cfg.teacher.update != "ema":
        return None
    return ema_step(_previous_teacher(run, iteration), student, rate=run.cfg.teacher.update_rate)


def _previous_teacher(run: Run, iteration: int) -> dict[str, Any]:
    """The EMA teacher iteration `iteration` starts from (the initial policy for the first), float32:
    the copy this process kept when it is the stored one (same sha256), else read from the store."""
    from storage.checkpoints import resolve_checkpoint
    from tasks import kept_weights
    from tasks.runtime import checkpoint_dir, ema_teacher_checkpoint

    n, kind = ema_teacher_checkpoint(iteration)
    if kind == "teacher":  # the first update starts from the base policy, read from the store
        kept = kept_weights.take(resolve_checkpoint(run.layout, f"iter-{n}", kind))
        if kept is not None:
            logger.info("EMA teacher of iteration %d: starting from the copy in memory", iteration)
            return kept
    return load_teacher_weights(checkpoint_dir(run, n, kind))


def load_teacher_weights(folder: Path) -> dict[str, Any]:
    """A checkpoint folder's weights with its floating tensors in float32 (the EMA's master copy)."""
    from safetensors.torch import load_file

    return {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(folder / WEIGHTS_FILE)).items()}


def ema_step(teacher: dict[str, Any], student: dict[str, Any], *, rate: float) -> dict[str, Any]:
    """`teacher` (float32) moved toward `student` by `rate`, on the student's device: in place
    where it is there already (the copy the last update kept), else as a copy moved there.

    The teacher is the EMA's master copy: with bf16 weights and tau = 0.05, an update of 5% of a
    weight's distance to the student rounds away for most weights and the teacher would never move,
    so it is updated and stored in float32 whatever the policy's dtype. On a GPU the update is a
    pass over device memory, from the weights the optimizer just wrote.
    """
    from sdpo_core.teacher_update import ema_update_

    device = next(iter(student.values())).device
    teacher = {name: tensor.to(device) for name, tensor in teacher.items()}
    ema_update_(teacher, student, rate=rate)
    return teacher


def _store_checkpoint(
    run: Run,
    weights: dict[str, Any],
    folder: Path,
    iteration: int,
    kind: str,
    *,
    hf_config: Any,
    tokenizer: Any,
    config_dtype: Any,
    parent: Any,
    trained_on: Any,
) -> tuple[dict[str, Any], Any]:
    """Write `weights` as the HF folder of checkpoint `kind` (the weights file hashed as it is
    written) and upload it; `parent` is a manifest or a future of one (the policy's, for the EMA
    teacher, waited for only once the teacher's own folder is written). Returns (the host copies
    written, the checkpoint manifest)."""
    from concurrent.futures import Future

    from storage.checkpoints import upload_checkpoint
    from tasks.megatron.hf_export import write_hf_folder

    written, digest = write_hf_folder(weights, hf_config, folder, tokenizer=tokenizer, config_dtype=config_dtype)
    handover.digest_taken(run.url, iteration, kind, digest)
    if isinstance(parent, Future):
        parent = parent.result()[1]
    manifest = upload_checkpoint(
        folder,
        run.layout,
        iteration,
        kind,
        parent=parent,
        trained_on=trained_on,
        handed_over=run.cfg.storage.link_uploads,
        written={WEIGHTS_FILE: digest},
    )
    return written, manifest


def run_train(root: str, run_name: str, iteration: int) -> dict | None:
    """Training stage of `iteration`: returns its manifest (a committed one is checked, then reused).

    Its outputs are the checkpoints of `iteration` plus the stage manifest naming them, written
    last. Checkpoints found without that manifest come from an attempt that was killed; they are
    discarded and the iteration is trained again, which gives the same weights.

    Under torchrun every rank trains (tensor x data parallel) and saves its share; rank 0 alone
    discards, uploads and writes manifests, and returns the manifest (the other ranks return None).
    """
    import torch.distributed as dist

    from storage.adopt import adopt_stage
    from storage.cache import adopt_into_cache
    from storage.checkpoints import discard_checkpoint, read_checkpoint_manifest, resolve_checkpoint, upload_checkpoint
    from storage.faults import crash_point
    from storage.layout import CHECKPOINT_KINDS
    from storage.manifest import read_stage_manifest, stage_done
    from storage.shard_reader import read_stage_columns
    from storage.stages import write_stage_manifest
    from tasks import kept_weights
    from tasks.megatron.batches import TRAIN_COLUMNS
    from tasks.megatron.parallel import init_parallel
    from tasks.megatron.resume import full_state_due, get_trainer, start_full_state_save, upload_full_state
    from tasks.megatron.shared_scratch import check_shared, mark_shared, shared_scratch
    from tasks.runtime import cache_bound_bytes, open_run
    from tasks.tokenizers import stored_tokenizer

    run = open_run(root, run_name)
    cfg = run.cfg
    if stage_done(run.layout, iteration, "train"):
        # committed by an earlier attempt: checked against its digests before it is reused
        manifest = adopt_stage(run.layout, iteration, "train", hash_files=cfg.storage.verify_sha256)
        logger.info("iteration %d training already committed; checked, reusing it", iteration)
        return manifest
    init_parallel(tensor_parallel=cfg.train.tensor_parallel, seed=cfg.seed)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        crash_point("stage.start:train", iteration)
        for kind in CHECKPOINT_KINDS:
            discard_checkpoint(run.layout, iteration, kind)
    dist.barrier()

    started = time.perf_counter()
    parent = read_stage_manifest(run.layout, iteration, "teacher")
    columns = read_stage_columns(
        run.layout, iteration, "teacher", columns=TRAIN_COLUMNS, verify=cfg.storage.verify_sha256
    )
    trainer = get_trainer(run, iteration)
    train_started = time.perf_counter()
    metrics = trainer.train_iteration(columns, iteration=iteration)
    metrics["train/seconds"] = time.perf_counter() - train_started
    tokens = float(sum(len(r) for r in columns["response_ids"]) + sum(len(p) for p in columns["prompt_ids"]))
    metrics["train/tokens_per_second"] = tokens / max(metrics["train/seconds"], 1e-9)
    metrics["train/ranks"] = float(world)
    crash_point("train.trained", iteration)

    previous = resolve_checkpoint(run.layout, iteration - 1, "policy")
    # the policy's tokenizer files are the previous policy's: from the tokenizer this process keeps,
    # else fetched without the previous policy's weights, which this stage never reads
    tokenizer = stored_tokenizer(
        run.layout, previous, cache_dir=cfg.storage.cache_dir, verify=cfg.storage.verify_sha256
    )
    # The checkpoints are written and uploaded on threads of their own while the stage goes on:
    # the policy's weights are gathered on the device, the EMA teacher is updated there from them,
    # and each writer copies its weights to the host, serialises them once and hashes them as they
    # are written, so no upload reads its weights file back. The teacher's upload waits for the
    # policy's manifest (its parent); the stage manifest waits for all of them. The scratch files
    # are handed over: with `storage.link_uploads`, a file:// store on their file system takes
    # them as hard links instead of copying them.
    with shared_scratch(cfg.storage.cache_dir, rank) as tmp_path, ThreadPoolExecutor(2, "checkpoint") as writers:
        clock = time.perf_counter()
        exported = trainer.export_hf()  # collective; rank 0 gets the policy's weights on the device
        metrics["train/export_seconds"], clock = time.perf_counter() - clock, time.perf_counter()
        produced = []
        uploaded: list[tuple[Path, Any]] = []  # (folder, its checkpoint manifest): weights the next stages load
        teacher_job = None
        if rank == 0:
            assert exported is not None
            dtype = next(iter(exported.values())).dtype
            common = {"hf_config": trainer.hf_config, "tokenizer": tokenizer, "config_dtype": dtype}
            policy_dir, teacher_dir = tmp_path / "policy", tmp_path / "teacher"
            policy_job = writers.submit(
                _store_checkpoint, run, exported, policy_dir, iteration, "policy",
                parent=previous, trained_on=[parent], **common,
            )  # fmt: skip
            teacher = update_teacher(run, iteration, student=exported)
            metrics["train/teacher_update_seconds"] = time.perf_counter() - clock
            # the next iteration's rollout and teacher prefill may start from these now (tasks/handover.py)
            offered = {"policy": exported} if teacher is None else {"policy": exported, "teacher": teacher}
            if handover.offer(run.url, iteration, offered) is not None:
                crash_point("train.handed_over", iteration)
            # what the next iteration waits for, with pipelined commits: the rest runs beside it
            metrics["train/handover_seconds"] = time.perf_counter() - started
            if teacher is not None:
                teacher_job = writers.submit(
                    _store_checkpoint, run, teacher, teacher_dir, iteration, "teacher",
                    parent=policy_job, trained_on=[parent], **common,
                )  # fmt: skip
        last = iteration == cfg.iterations
        save_started = time.perf_counter()
        # the full state an earlier iteration saved in the background, completed here (collective)
        earlier = trainer.finish_megatron_save()
        mdir = None
        due = last or full_state_due(run, iteration)
        if due and not last and handover.slot(run.url, iteration) is not None:
            # this process trains the next iteration too (pipelined commits): staged to host memory
            # here, written on a thread, uploaded and named by the next train stage
            start_full_state_save(trainer, cfg.storage.cache_dir, iteration=iteration)
        elif due:  # saved before the stage commits (the run's end, or a process that ends here)
            mdir = tmp_path / "megatron"
            trainer.save_megatron(mdir, iteration=iteration)  # collective; every rank writes its shards
            mark_shared(tmp_path, rank, world)
        metrics["train/megatron_save_seconds"] = time.perf_counter() - save_started
        if rank == 0:
            clock = time.perf_counter()
            policy, policy_manifest = policy_job.result()
            kept_weights.keep(policy_manifest, policy)  # for the next stages of this process
            produced.append(policy_manifest)
            uploaded.append((policy_dir, policy_manifest))
            if teacher_job is not None:
                teacher_manifest = teacher_job.result()[1]
                kept_weights.keep(teacher_manifest, teacher)  # the float32 master, where it was updated
                produced.append(teacher_manifest)
                uploaded.append((teacher_dir, teacher_manifest))
            metrics["train/upload_wait_seconds"] = time.perf_counter() - clock
            del exported  # views of the model's weights: nothing reads them once the writers are done
            upload_started = time.perf_counter()
            # the full state the previous iteration saved in the background, named by this stage:
            # the commit that names it waited for it
            if earlier is not None:
                produced.append(upload_full_state(run, earlier))
            elif full_state_due(run, iteration - 1):  # uploaded by an attempt of this stage that did not commit
                produced.append(read_checkpoint_manifest(run.layout, iteration - 1, "megatron"))
            if mdir is not None:
                if world > 1:
                    check_shared(tmp_path, world)
                full_state = upload_checkpoint(
                    mdir,
                    run.layout,
                    iteration,
                    "megatron",
                    parent=produced[0],
                    trained_on=[parent],
                    handed_over=cfg.storage.link_uploads,
                )
                if last:  # before the run's end it is named by the next train stage, as a background save is
                    produced.append(full_state)
            metrics["train/megatron_upload_seconds"] = time.perf_counter() - upload_started
        if earlier is not None:
            earlier.release()  # collective: its scratch folder goes once rank 0 uploaded it
        for folder, manifest in uploaded:  # the next stages read these from the cache, not from the store
            adopt_into_cache(folder, manifest, cache_dir=cfg.storage.cache_dir, max_cache_bytes=cache_bound_bytes(cfg))
    if rank != 0:
        return None
    metrics["train/stage_seconds"] = time.perf_counter() - started
    return write_stage_manifest(run.layout, iteration, "train", parents=[parent, *produced], metrics=metrics)
