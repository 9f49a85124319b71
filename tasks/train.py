"""Training stage on megatron-core: algorithm-blind.

Reads the teacher shards (every per-sample decision arrives as a column: reward, advantage,
sample mask, the student's top-K ids, the teacher's log-probs on them), recomputes the student's
log-probs on the same ids with gradients, applies the configured `sdpo_core` loss, steps the
optimizer, updates the teacher per its mode, and saves the policy (HF safetensors for the engines,
a Megatron distributed checkpoint with optimizer, scheduler, RNG and data cursor for resuming).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import random
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from tasks.config import RunConfig
from tasks.runtime import Run

logger = logging.getLogger(__name__)

_TRAINERS: dict[str, "MegatronTrainer"] = {}


# ----------------------------------------------------------------------------------------------
# batches


@dataclass
class Batch:
    """Padded tensors of one micro-batch. B samples, S = longest prompt+response, T = longest response."""

    tokens: Any  # [B, S] int64, right padded
    position_ids: Any  # [B, S]
    response_positions: Any  # [B, T] index into S of the logits predicting response token t
    response_ids: Any  # [B, T]
    response_mask: Any  # [B, T] bool
    topk_ids: Any  # [B, T, K]
    teacher_topk_logprobs: Any  # [B, T, K]
    teacher_token_logprobs: Any  # [B, T]
    old_token_logprobs: Any  # [B, T] behaviour policy (rollout engine)
    advantages: Any  # [B]
    sample_mask: Any  # [B] bool
    # Packed micro-batches (train.packing): tokens is one row [1, L] of the samples end to end.
    logit_rows: Any = None  # [B, T] flat index into the micro-batch's logits [B' * S'] per response token
    packed_seq_params: Any = None  # Megatron PackedSeqParams (thd, boundaries on the CPU)

    def to(self, device: Any) -> Batch:
        """The same batch with its tensors on `device` (the packing boundaries stay on the CPU)."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if f.name != "packed_seq_params" and getattr(self, f.name) is not None
        }
        return dataclasses.replace(self, **moved)


def make_batch(columns: dict[str, Any], rows: list[int]) -> Batch:
    """Pad the given rows of the teacher columns into one micro-batch (no per-token Python loops)."""
    import torch

    prompts = [np.asarray(columns["prompt_ids"][i], dtype=np.int64) for i in rows]
    responses = [np.asarray(columns["response_ids"][i], dtype=np.int64) for i in rows]
    k = int(np.asarray(columns["topk_ids"][rows[0]]).shape[-1])
    b = len(rows)
    s = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    t = max(1, max(len(r) for r in responses))
    tokens = np.zeros((b, s), dtype=np.int64)
    resp_pos = np.zeros((b, t), dtype=np.int64)
    resp_ids = np.zeros((b, t), dtype=np.int64)
    mask = np.zeros((b, t), dtype=bool)
    topk_ids = np.zeros((b, t, k), dtype=np.int64)
    teacher_topk = np.zeros((b, t, k), dtype=np.float32)
    teacher_tok = np.zeros((b, t), dtype=np.float32)
    old_tok = np.zeros((b, t), dtype=np.float32)
    for j, (i, p, r) in enumerate(zip(rows, prompts, responses, strict=True)):
        n_p, n_r = len(p), len(r)
        tokens[j, :n_p] = p
        tokens[j, n_p : n_p + n_r] = r
        resp_pos[j, :n_r] = np.arange(n_p - 1, n_p - 1 + n_r)
        resp_ids[j, :n_r] = r
        mask[j, :n_r] = True
        topk_ids[j, :n_r] = np.asarray(columns["topk_ids"][i])
        teacher_topk[j, :n_r] = np.asarray(columns["teacher_topk_logprobs"][i])
        teacher_tok[j, :n_r] = np.asarray(columns["teacher_sampled_logprobs"][i])
        old_tok[j, :n_r] = np.asarray(columns["sampled_logprobs"][i])
    positions = np.broadcast_to(np.arange(s, dtype=np.int64), (b, s)).copy()
    return Batch(
        tokens=torch.from_numpy(tokens),
        position_ids=torch.from_numpy(positions),
        response_positions=torch.from_numpy(resp_pos),
        response_ids=torch.from_numpy(resp_ids),
        response_mask=torch.from_numpy(mask),
        topk_ids=torch.from_numpy(topk_ids),
        teacher_topk_logprobs=torch.from_numpy(teacher_topk),
        teacher_token_logprobs=torch.from_numpy(teacher_tok),
        old_token_logprobs=torch.from_numpy(old_tok),
        advantages=torch.as_tensor(np.asarray([columns["advantage"][i] for i in rows], dtype=np.float32)),
        sample_mask=torch.as_tensor(np.asarray([bool(columns["sample_mask"][i]) for i in rows])),
    )


def make_packed_batch(columns: dict[str, Any], rows: list[int], *, pad_to_multiple: int = 8) -> Batch:
    """The rows as one packed row [1, L] (see `tasks.megatron.packing`), with the padded loss inputs."""
    from tasks.megatron.packing import pack_sequences

    batch = make_batch(columns, rows)
    packed = pack_sequences(
        [columns["prompt_ids"][i] for i in rows],
        [columns["response_ids"][i] for i in rows],
        pad_to_multiple=pad_to_multiple,
    )
    width = batch.response_ids.shape[1]
    logit_rows = packed.logit_rows.new_zeros((len(rows), width))
    logit_rows[:, : packed.logit_rows.shape[1]] = packed.logit_rows[:, :width]
    return dataclasses.replace(
        batch,
        tokens=packed.tokens,
        position_ids=packed.position_ids,
        response_positions=logit_rows,
        logit_rows=logit_rows,
        packed_seq_params=packed.packed_seq_params(),
    )


def micro_batches(cfg: RunConfig, columns: dict[str, Any], rows: list[int]) -> list[Batch]:
    """This rank's micro-batches: `micro_batch_size` padded rows each, or token-budget packs."""
    if not cfg.train.packing:
        size = cfg.train.micro_batch_size
        return [make_batch(columns, rows[i : i + size]) for i in range(0, len(rows), size)]
    from tasks.megatron.packing import plan_packs

    lengths = [len(columns["prompt_ids"][i]) + len(columns["response_ids"][i]) for i in rows]
    packs = plan_packs(lengths, capacity=cfg.train.pack_tokens)
    return [make_packed_batch(columns, [rows[j] for j in pack]) for pack in packs]


def mini_batch_denominators(cfg: RunConfig, columns: dict[str, Any], rows: list[int]) -> tuple[Any, Any]:
    """(SDPO, GRPO) loss normalisers of a whole mini-batch; GRPO counts every sample. Only the
    response lengths and sample masks are read (the masks `make_batch` would build)."""
    import torch

    from sdpo_core.losses import loss_denominator

    lengths = torch.tensor([len(columns["response_ids"][i]) for i in rows])
    response_mask = torch.arange(max(1, int(lengths.max()))) < lengths[:, None]  # [B, T]
    sample_mask = torch.as_tensor(np.asarray([bool(columns["sample_mask"][i]) for i in rows]))
    kw = {"reduction": cfg.loss.mask_reduction, "aggregation": cfg.loss.aggregation}
    sdpo = loss_denominator(response_mask, sample_mask, **kw)
    grpo = loss_denominator(response_mask, torch.ones_like(sample_mask), **kw)
    return sdpo, grpo


def minibatch_rows(n_rows: int, *, steps: int, seed: int, iteration: int) -> list[list[int]]:
    """The rows of each optimizer step: a seeded shuffle split into `steps` equal mini-batches."""
    if n_rows % steps:
        raise ValueError(f"{n_rows} samples cannot be split into {steps} equal mini-batches")
    order = list(range(n_rows))
    random.Random(f"train:{seed}:{iteration}").shuffle(order)
    size = n_rows // steps
    return [order[i * size : (i + 1) * size] for i in range(steps)]


# ----------------------------------------------------------------------------------------------
# the trainer


class MegatronTrainer:
    """A megatron-core GPTModel with its DDP wrapper, optimizer and LR schedule, kept per process."""

    def __init__(self, cfg: RunConfig, hf_dir: Path, *, load_weights: bool = True) -> None:
        """`load_weights=False` keeps Megatron's random init (benchmarks need only config.json)."""
        import torch
        from transformers import AutoConfig

        from tasks.megatron.convert import load_hf_into_megatron
        from tasks.megatron.model import build_gpt_model
        from tasks.megatron.parallel import init_parallel

        self.cfg = cfg
        init_parallel(tensor_parallel=cfg.train.tensor_parallel, seed=cfg.seed)
        self.hf_config = AutoConfig.from_pretrained(str(hf_dir))
        dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
        # The unchunked loss takes a full-vocabulary logsumexp of gathered logits; the chunked one
        # works on vocab-sharded logits under tensor parallelism (never gathered).
        self.sharded_logits = cfg.train.loss_chunk_tokens > 0 and cfg.train.tensor_parallel > 1
        model = build_gpt_model(
            self.hf_config,
            params_dtype=dtype,
            parallel_output=self.sharded_logits,
            attention=cfg.train.attention,
            recompute=cfg.train.recompute,
            fused_kernels=cfg.train.fused_kernels,
        )
        if load_weights:
            load_hf_into_megatron(model, str(hf_dir))
        self.vocab_size = int(self.hf_config.vocab_size)
        self._wrap(model)
        self.iteration = 0  # the iteration whose output these weights are

    def _wrap(self, model: Any) -> None:
        import torch
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        opt = self.cfg.optimizer
        bf16 = self.cfg.model.dtype == "bfloat16"
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        )
        from megatron.core.distributed import finalize_model_grads

        self.model = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
        # After the backward passes: data-parallel gradient reduction, and the tensor-parallel
        # all-reduce of replicated parameters that see only their rank's heads (q/k layernorm).
        model.config.finalize_model_grads_func = finalize_model_grads
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=opt.lr,
                min_lr=opt.lr * opt.min_lr_ratio,
                weight_decay=opt.weight_decay,
                adam_beta1=opt.betas[0],
                adam_beta2=opt.betas[1],
                clip_grad=opt.grad_clip,
                bf16=bf16,
                params_dtype=torch.bfloat16 if bf16 else torch.float32,
            ),
            [self.model],
        )
        if self.cfg.train.fused_kernels:
            from tasks.megatron.fusions import use_fused_adamw

            use_fused_adamw(self.optimizer)
        total_steps = max(1, self.cfg.iterations * self.cfg.train.steps_per_iteration)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if opt.warmup_steps else opt.lr,
            max_lr=opt.lr,
            min_lr=opt.lr * opt.min_lr_ratio if opt.schedule == "cosine" else opt.lr,
            lr_warmup_steps=opt.warmup_steps,
            lr_decay_steps=max(total_steps, opt.warmup_steps + 1),
            lr_decay_style="cosine" if opt.schedule == "cosine" else "constant",
            start_wd=opt.weight_decay,
            end_wd=opt.weight_decay,
            wd_incr_steps=total_steps,
            wd_incr_style="constant",
        )

    # -- one iteration -------------------------------------------------------------------------

    def _loss_func(
        self, batch: Batch, denominators: tuple[Any, Any], scale: float, logits: Any
    ) -> tuple[Any, dict[str, Any]]:
        import torch

        from sdpo_core.losses import LossInputs, policy_loss

        cfg = self.cfg
        if cfg.train.loss_chunk_tokens > 0:
            student_topk, student_tok = self._chunked_student_logprobs(batch, logits)
        else:
            logits = logits[..., : self.vocab_size].float()  # Megatron may pad the vocabulary
            if batch.logit_rows is not None:
                resp_logits = logits.reshape(-1, logits.shape[-1])[batch.logit_rows]  # [B, T, V]
            else:
                index = batch.response_positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
                resp_logits = torch.gather(logits, 1, index)  # [B, T, V]
            lse = torch.logsumexp(resp_logits, dim=-1, keepdim=True)  # [B, T, 1]
            student_topk = torch.gather(resp_logits, -1, batch.topk_ids) - lse  # [B, T, K]
            student_tok = torch.gather(resp_logits, -1, batch.response_ids.unsqueeze(-1)).squeeze(-1) - lse.squeeze(-1)
        out = policy_loss(
            LossInputs(
                student_topk_logprobs=student_topk,
                teacher_topk_logprobs=batch.teacher_topk_logprobs,
                student_token_logprobs=student_tok,
                old_token_logprobs=batch.old_token_logprobs,
                teacher_token_logprobs=batch.teacher_token_logprobs,
                advantages=batch.advantages,
                response_mask=batch.response_mask,
                sample_mask=batch.sample_mask,
                sdpo_denominator=denominators[0],
                grpo_denominator=denominators[1],
            ),
            loss_type=cfg.loss.type,
            divergence="topk_tail" if cfg.loss.divergence == "full" else cfg.loss.divergence,
            alpha=cfg.loss.alpha,
            blend_lambda=1.0 if cfg.loss.type == "grpo" else cfg.loss.blend_lambda,
            is_clip=cfg.loss.is_clip,
            reduction=cfg.loss.mask_reduction,
            aggregation=cfg.loss.aggregation,
            clip_low=cfg.loss.clip_low,
            clip_high=cfg.loss.clip_high,
        )
        metrics = {name: torch.tensor(float(value)) for name, value in out.metrics.items()}
        return out.loss * scale, metrics

    def _chunked_student_logprobs(self, batch: Batch, logits: Any) -> tuple[Any, Any]:
        """Student log-probs at the top-K ids [B, T, K] and the sampled ids [B, T], streamed over
        token and vocabulary chunks (`sdpo_core.chunked`); vocab-parallel when the logits are sharded."""
        import torch

        from sdpo_core.chunked import chunked_token_logprobs
        from tasks.megatron.vocab_parallel import tensor_parallel_token_logprobs

        flat = logits.reshape(-1, logits.shape[-1])  # [B' * S', V_local]
        if batch.logit_rows is not None:
            logit_rows = batch.logit_rows
        else:
            width = logits.shape[1]
            offsets = torch.arange(batch.response_positions.shape[0], device=flat.device)[:, None] * width
            logit_rows = batch.response_positions + offsets  # [B, T]
        mask = batch.response_mask  # [B, T]
        ids = torch.cat([batch.topk_ids, batch.response_ids.unsqueeze(-1)], dim=-1)  # [B, T, K+1]
        kwargs = {
            "vocab_size": self.vocab_size,
            "chunk_tokens": self.cfg.train.loss_chunk_tokens,
            "compile": self.cfg.train.loss_compile,
        }
        if self.sharded_logits:
            picked = tensor_parallel_token_logprobs(flat, logit_rows[mask], ids[mask], **kwargs)  # [N, K+1]
        else:
            picked = chunked_token_logprobs(flat, logit_rows[mask], ids[mask], **kwargs)  # [N, K+1]
        full = picked.new_zeros(ids.shape)  # [B, T, K+1]
        full[mask] = picked
        return full[..., :-1], full[..., -1]

    def train_iteration(self, columns: dict[str, Any], *, iteration: int) -> dict[str, float]:
        import torch
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        cfg = self.cfg
        seed_training_rng(cfg.seed, iteration)
        n_rows = len(columns["sample_id"])
        dp_rank = parallel_state.get_data_parallel_rank()
        dp_size = parallel_state.get_data_parallel_world_size()
        step_metrics: list[dict[str, float]] = []
        plan = minibatch_rows(n_rows, steps=cfg.train.steps_per_iteration, seed=cfg.seed, iteration=iteration)

        def host_inputs(rows: list[int]) -> tuple[list[Batch], tuple[Any, Any]]:
            # Every micro-batch divides by the whole mini-batch's normaliser, so the summed
            # gradient equals that of the mini-batch loss.
            return micro_batches(cfg, columns, rows[dp_rank::dp_size]), mini_batch_denominators(cfg, columns, rows)

        upcoming = host_inputs(plan[0])
        for index in range(len(plan)):
            batches, denominators = upcoming
            # Megatron divides each micro-batch loss by their count and DDP averages over
            # data-parallel ranks, both undone by `scale`.
            scale = float(len(batches) * dp_size)
            data = iter(batches)
            device = next(self.model.parameters()).device

            def forward_step(data_iterator: Any, model: Any) -> tuple[Any, Any]:
                batch = next(data_iterator).to(device)
                logits = model(batch.tokens, batch.position_ids, None, packed_seq_params=batch.packed_seq_params)
                return logits, partial(self._loss_func, batch, denominators, scale)

            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            reduced = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=data,
                model=[self.model],
                num_microbatches=len(batches),
                seq_length=int(max(b.tokens.shape[1] for b in batches)),
                micro_batch_size=int(batches[0].tokens.shape[0]),
                forward_only=False,
            )
            if index + 1 < len(plan):
                # The backward pass is queued on the device: build the next step's batches meanwhile,
                # before the optimizer step waits for it (the gradient norm).
                upcoming = host_inputs(plan[index + 1])
            update_ok, grad_norm, _ = self.optimizer.step()
            if not update_ok:
                raise RuntimeError(f"optimizer step failed at iteration {iteration} (grad norm {grad_norm})")
            self.scheduler.step(increment=1)
            merged: dict[str, float] = {}
            for name in reduced[0]:
                merged[name] = float(torch.stack([r[name] for r in reduced]).mean())
            # Each micro-batch loss is its share of the mini-batch mean (global normaliser), so the
            # mini-batch loss is their sum over micro-batches and data-parallel ranks.
            loss_sum = torch.stack([r["loss/total"] for r in reduced]).sum().reshape(1)
            if dp_size > 1:
                torch.distributed.all_reduce(loss_sum, group=parallel_state.get_data_parallel_group())
            merged["train/loss"] = float(loss_sum)
            merged["train/grad_norm"] = float(grad_norm)
            merged["train/lr"] = float(self.optimizer.param_groups[0]["lr"])
            step_metrics.append(merged)
        self.iteration = iteration
        return {name: float(np.mean([m[name] for m in step_metrics])) for name in step_metrics[0]}

    # -- persistence ---------------------------------------------------------------------------

    def save_hf(self, out_dir: Path, tokenizer_dir: Path) -> None:
        from tasks.megatron.convert import save_megatron_as_hf

        save_megatron_as_hf(self.model.module, self.hf_config, str(out_dir), tokenizer_dir=str(tokenizer_dir))

    def save_megatron(self, out_dir: Path, *, iteration: int) -> None:
        """The full training state after `iteration`: weights (fp32 master copies included), Adam's
        moments and step, the LR schedule. RNG state is not saved: every iteration seeds it from
        (seed, iteration, data-parallel rank), see `seed_training_rng`."""
        import torch
        from megatron.core import dist_checkpointing

        from storage.faults import crash_point

        out_dir.mkdir(parents=True, exist_ok=True)
        state = self.model.module.sharded_state_dict(prefix="model.")
        state["optimizer"] = self.optimizer.sharded_state_dict(state)
        dist_checkpointing.save(state, str(out_dir))
        crash_point("checkpoint.saving:megatron", iteration)
        if torch.distributed.get_rank() == 0:  # the same on every rank
            torch.save({"scheduler": self.scheduler.state_dict(), "iteration": iteration}, out_dir / "trainer_state.pt")
            (out_dir / "cursor.json").write_text(json.dumps({"iteration": iteration}))

    def load_megatron(self, ckpt_dir: Path) -> None:
        """Restore what `save_megatron` wrote. The optimizer's template is built for loading
        (`is_loading=True` creates Adam's state tensors), so its moments and step are read too."""
        import torch
        from megatron.core import dist_checkpointing

        state = self.model.module.sharded_state_dict(prefix="model.")
        state["optimizer"] = self.optimizer.sharded_state_dict(state, is_loading=True)
        loaded = dist_checkpointing.load(state, str(ckpt_dir))
        model_state = {k.removeprefix("model."): v for k, v in loaded.items() if k.startswith("model.")}
        self.model.module.load_state_dict(model_state, strict=False)
        self.optimizer.load_state_dict(loaded["optimizer"])
        extra = torch.load(ckpt_dir / "trainer_state.pt", weights_only=False)
        self.scheduler.load_state_dict(extra["scheduler"])
        self.iteration = int(extra["iteration"])


def seed_training_rng(seed: int, iteration: int) -> None:
    """Seed every RNG training may draw from (torch, numpy, python, Megatron's model-parallel
    tracker) from (seed, iteration, data-parallel rank) alone: an iteration trains the same way
    whether its process trained the previous one, resumed from the store, or replayed."""
    import torch
    from megatron.core import parallel_state, tensor_parallel as mcore_tp

    rank = parallel_state.get_data_parallel_rank()
    value = int(np.random.SeedSequence([seed, iteration, rank]).generate_state(1)[0])
    torch.manual_seed(value)
    mcore_tp.model_parallel_cuda_manual_seed(value)  # adds the tensor-parallel rank's offset itself
    np.random.seed(value)
    random.seed(value)


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
    from tasks.runtime import checkpoint_dir

    start = full_state_iteration(run, iteration)
    # The base model gives the architecture (and the weights when start = 0); retention never prunes it.
    trainer = MegatronTrainer(run.cfg, checkpoint_dir(run, 0, "policy"))
    if start > 0:
        trainer.load_megatron(checkpoint_dir(run, start, "megatron"))
    for m in range(start + 1, iteration + 1):
        logger.info("replaying the training of iteration %d from its teacher shards (full state of iteration %d)", m, start)
        columns = read_stage_columns(run.layout, m, "teacher", verify=run.cfg.storage.verify_sha256)
        trainer.train_iteration(columns, iteration=m)
        check_replay(run, trainer, m)
    trainer.iteration = iteration
    return trainer


def check_replay(run: Run, trainer: MegatronTrainer, iteration: int) -> None:
    """Fail when replaying `iteration` did not reproduce the policy weights it committed."""
    import torch

    from storage.checkpoints import read_checkpoint_manifest
    from storage.objects import sha256_local_file
    from storage.scratch import scratch_dir
    from tasks.runtime import checkpoint_dir

    stored = {e["name"]: e["sha256"] for e in read_checkpoint_manifest(run.layout, iteration, "policy").data["files"]}
    with scratch_dir(run.cfg.storage.cache_dir, "replay") as tmp:
        trainer.save_hf(tmp, checkpoint_dir(run, 0, "policy"))  # collective; rank 0 writes (tokenizer: the base's)
        if torch.distributed.get_rank() != 0:
            return
        replayed = sha256_local_file(tmp / "model.safetensors")
    if replayed != stored["model.safetensors"]:
        raise RuntimeError(
            f"replaying iteration {iteration} of run {run.layout.run_name!r} gave weights {replayed[:12]}, but its "
            f"committed policy has {stored['model.safetensors'][:12]}: training is not deterministic here, so "
            "resume exactly needs train.megatron_checkpoint_every=1"
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


def update_teacher(run: Run, iteration: int, policy_dir: Path, out_dir: Path) -> bool:
    """Write the EMA teacher of `iteration` into out_dir; False when the mode keeps no teacher copy."""
    if run.cfg.teacher.update != "ema":
        return False
    from tasks.runtime import teacher_source

    previous, _ = teacher_source(run, iteration)
    ema_teacher_folder(previous, policy_dir, out_dir, rate=run.cfg.teacher.update_rate)
    return True


def ema_teacher_folder(previous: Path, policy_dir: Path, out_dir: Path, *, rate: float) -> None:
    """`out_dir` = the policy folder with its weights replaced by the EMA teacher's, kept in float32.

    The teacher is the EMA's master copy: with bf16 weights and tau = 0.05, an update of 5% of a
    weight's distance to the student rounds away for most weights and the teacher would never move,
    so the teacher is read, updated and stored in float32 whatever the policy's dtype.
    """
    import shutil

    from safetensors.torch import load_file, save_file

    from sdpo_core.teacher_update import ema_update_

    teacher = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(previous / "model.safetensors")).items()}
    student = load_file(str(policy_dir / "model.safetensors"))
    ema_update_(teacher, student, rate=rate)
    shutil.copytree(policy_dir, out_dir, dirs_exist_ok=True)
    save_file(teacher, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


@contextlib.contextmanager
def _shared_scratch(cache_dir: str, rank: int) -> Any:
    """A scratch folder every rank writes into: rank 0 makes it, the others are told its path."""
    import torch.distributed as dist

    from storage.scratch import scratch_dir

    holder: list[Any] = [None]
    with contextlib.ExitStack() as stack:
        if rank == 0:
            holder[0] = str(stack.enter_context(scratch_dir(cache_dir, "ckpt")))
        dist.broadcast_object_list(holder, src=0)
        yield Path(holder[0])
        dist.barrier()  # nobody is still writing when rank 0 removes it


def _check_shared(folder: Path, world: int) -> None:
    """Every rank left its marker in `folder`: the ranks share the file system the checkpoint needs."""
    missing = [r for r in range(world) if not (folder / f".rank-{r}").exists()]
    if missing:
        raise RuntimeError(
            f"ranks {missing} wrote their checkpoint shards somewhere rank 0 cannot see ({folder}): with "
            "torchrun over several nodes, storage.cache_dir must be on a file system all nodes share"
        )


def run_train(root: str, run_name: str, iteration: int) -> dict | None:
    """Training stage of `iteration`: returns its manifest (skips when already committed).

    Its outputs are the checkpoints of `iteration` plus the stage manifest naming them, written
    last. Checkpoints found without that manifest come from an attempt that was killed; they are
    discarded and the iteration is trained again, which gives the same weights.

    Under torchrun every rank trains (tensor x data parallel) and saves its share; rank 0 alone
    discards, uploads and writes manifests, and returns the manifest (the other ranks return None).
    """
    import torch.distributed as dist

    from storage.checkpoints import discard_checkpoint, resolve_checkpoint, upload_checkpoint
    from storage.faults import crash_point
    from storage.layout import CHECKPOINT_KINDS
    from storage.manifest import read_stage_manifest, stage_done
    from storage.shard_reader import read_stage_columns
    from storage.stages import write_stage_manifest
    from tasks.megatron.parallel import init_parallel
    from tasks.runtime import checkpoint_dir, open_run

    run = open_run(root, run_name)
    cfg = run.cfg
    if stage_done(run.layout, iteration, "train"):
        logger.info("iteration %d training already committed; reusing it", iteration)
        return read_stage_manifest(run.layout, iteration, "train")
    init_parallel(tensor_parallel=cfg.train.tensor_parallel, seed=cfg.seed)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        crash_point("stage.start:train", iteration)
        for kind in CHECKPOINT_KINDS:
            discard_checkpoint(run.layout, iteration, kind)
    dist.barrier()

    started = time.perf_counter()
    parent = read_stage_manifest(run.layout, iteration, "teacher")
    columns = read_stage_columns(run.layout, iteration, "teacher", verify=cfg.storage.verify_sha256)
    trainer = get_trainer(run, iteration)
    train_started = time.perf_counter()
    metrics = trainer.train_iteration(columns, iteration=iteration)
    metrics["train/seconds"] = time.perf_counter() - train_started
    tokens = float(sum(len(r) for r in columns["response_ids"]) + sum(len(p) for p in columns["prompt_ids"]))
    metrics["train/tokens_per_second"] = tokens / max(metrics["train/seconds"], 1e-9)
    metrics["train/ranks"] = float(world)
    crash_point("train.trained", iteration)

    base_dir = checkpoint_dir(run, iteration - 1, "policy")
    with _shared_scratch(cfg.storage.cache_dir, rank) as tmp_path:
        policy_dir = tmp_path / "policy"
        trainer.save_hf(policy_dir, base_dir)  # collective; rank 0 writes
        produced = []
        if rank == 0:
            policy_manifest = upload_checkpoint(
                policy_dir,
                run.layout,
                iteration,
                "policy",
                parent=resolve_checkpoint(run.layout, iteration - 1, "policy"),
                trained_on=[parent],
            )
            produced.append(policy_manifest)
            teacher_dir = tmp_path / "teacher"
            if update_teacher(run, iteration, policy_dir, teacher_dir):
                produced.append(
                    upload_checkpoint(teacher_dir, run.layout, iteration, "teacher", parent=policy_manifest, trained_on=[parent])
                )
        last = iteration == cfg.iterations
        if last or iteration % cfg.train.megatron_checkpoint_every == 0:
            save_started = time.perf_counter()
            mdir = tmp_path / "megatron"
            trainer.save_megatron(mdir, iteration=iteration)  # collective; every rank writes its shards
            if world > 1:
                (tmp_path / f".rank-{rank}").touch()
                dist.barrier()
            if rank == 0:
                if world > 1:
                    _check_shared(tmp_path, world)
                produced.append(
                    upload_checkpoint(mdir, run.layout, iteration, "megatron", parent=produced[0], trained_on=[parent])
                )
            metrics["train/megatron_save_seconds"] = time.perf_counter() - save_started
    if rank != 0:
        return None
    metrics["train/stage_seconds"] = time.perf_counter() - started
    return write_stage_manifest(run.layout, iteration, "train", parents=[parent, *produced], metrics=metrics)
