"""The trainer: a megatron-core GPTModel with its DDP wrapper, optimizer and LR schedule.

Algorithm-blind: every per-sample decision arrives as a column of the teacher shards (reward,
advantage, sample mask, the student's top-K ids, the teacher's log-probs on them). One
`train_iteration` recomputes the student's log-probs on those ids with gradients, applies the
configured `sdpo_core` loss and steps the optimizer; `save_megatron` / `load_megatron` hold the full
training state (weights, Adam's moments and step, the LR schedule) for resuming.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from tasks.config import RunConfig
from tasks.megatron.batches import Batch, Normalisers, micro_batches, mini_batch_denominators, minibatch_rows

# the key prefix under which a micro-batch's metric counts travel through Megatron's schedule
_COUNT = "count/"


class MegatronTrainer:
    """A megatron-core GPTModel with its DDP wrapper, optimizer and LR schedule, kept per process."""

    def __init__(self, cfg: RunConfig, hf_dir: Path, *, load_weights: bool = True) -> None:
        """`load_weights=False` keeps Megatron's random init (benchmarks need only config.json)."""
        import torch
        from transformers import AutoConfig

        from tasks.megatron.convert import load_hf_into_megatron
        from tasks.megatron.model import build_gpt_model
        from tasks.megatron.output_rows import OutputRows
        from tasks.megatron.parallel import init_parallel

        self.cfg = cfg
        init_parallel(tensor_parallel=cfg.train.tensor_parallel, seed=cfg.seed)
        self.hf_config = AutoConfig.from_pretrained(str(hf_dir))
        dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
        # The unchunked loss takes a full-vocabulary log-softmax of gathered logits; the chunked one
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
        self.output_rows = OutputRows(model)  # logits at the response positions alone
        self.vocab_size = int(self.hf_config.vocab_size)
        self._wrap(model)
        self.iteration = 0  # the iteration whose output these weights are
        self.pending_full_state: Any = None  # a full-state save still being written (tasks/megatron/full_state.py)

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
        self, batch: Batch, denominators: Normalisers, scale: float, logits: Any
    ) -> tuple[Any, dict[str, Any]]:
        import torch

        from sdpo_core.losses import LossInputs, policy_loss

        cfg = self.cfg
        student_topk, student_tok = self._student_logprobs(batch, logits)
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
                route_sdpo=batch.route_sdpo,
                teacher_entropy=batch.teacher_entropy,
                pass_rate=batch.pass_rate,
                sdpo_denominator=denominators.sdpo,
                grpo_denominator=denominators.grpo,
                entropy_weight_norm=denominators.entropy_weight,
                question_weight_norm=denominators.question_weight,
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
            srpo_beta=cfg.loss.srpo.beta,
            pass_rate_weight=cfg.loss.pass_rate_weight,
            ratio_cap=cfg.loss.ratio_cap,
        )
        metrics = {name: torch.tensor(float(value)) for name, value in out.metrics.items()}
        metrics.update({_COUNT + name: torch.tensor(float(n)) for name, n in out.metric_counts.items()})
        return out.loss * scale, metrics

    def _student_logprobs(self, batch: Batch, logits: Any) -> tuple[Any, Any]:
        """Student log-probs at the top-K ids [B, T, K] and the sampled ids [B, T] from the logits
        of the micro-batch's response positions ([1, N, V_local], `OutputRows`): a full-vocabulary
        logsumexp, or streamed over token and vocabulary chunks (`sdpo_core.chunked`), vocab-parallel
        when the logits are sharded."""
        import torch

        from sdpo_core.chunked import chunked_token_logprobs
        from tasks.megatron.vocab_parallel import tensor_parallel_token_logprobs

        mask = batch.response_mask  # [B, T]
        ids = torch.cat([batch.topk_ids, batch.response_ids.unsqueeze(-1)], dim=-1)  # [B, T, K+1]
        scored = ids[mask]  # [N, K+1]
        flat = logits.reshape(-1, logits.shape[-1])  # [N, V_local]
        if flat.shape[0] != scored.shape[0]:
            raise RuntimeError(f"{flat.shape[0]} logit rows for {scored.shape[0]} response tokens")
        if self.cfg.train.loss_chunk_tokens > 0:
            rows = torch.arange(flat.shape[0], device=flat.device)
            kwargs = {
                "vocab_size": self.vocab_size,
                "chunk_tokens": self.cfg.train.loss_chunk_tokens,
                "compile": self.cfg.train.loss_compile,
            }
            if self.sharded_logits:
                picked = tensor_parallel_token_logprobs(flat, rows, scored, **kwargs)  # [N, K+1]
            else:
                picked = chunked_token_logprobs(flat, rows, scored, **kwargs)  # [N, K+1]
        else:
            flat = flat[:, : self.vocab_size].float()  # Megatron may pad the vocabulary
            # log_softmax is one fused pass forward and one backward (with the gather's scatter); a
            # gather minus logsumexp took 2.5x as long on the CPU, in five passes and temporaries of [N, V]
            picked = torch.log_softmax(flat, dim=-1).gather(-1, scored)
        full = picked.new_zeros(ids.shape)  # [B, T, K+1]
        full[mask] = picked
        return full[..., :-1], full[..., -1]

    def train_iteration(self, columns: dict[str, Any], *, iteration: int) -> dict[str, float]:
        """One iteration's optimizer steps on its teacher shards' columns; returns the step metrics."""
        with deterministic_kernels(self.cfg.train.deterministic):
            return self._train_iteration(columns, iteration=iteration)

    def _train_iteration(self, columns: dict[str, Any], *, iteration: int) -> dict[str, float]:
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        cfg = self.cfg
        seed_training_rng(cfg.seed, iteration)
        n_rows = len(columns["sample_id"])
        dp_rank = parallel_state.get_data_parallel_rank()
        dp_size = parallel_state.get_data_parallel_world_size()
        step_metrics: list[dict[str, float]] = []
        plan = minibatch_rows(n_rows, steps=cfg.train.steps_per_iteration, seed=cfg.seed, iteration=iteration)

        def host_inputs(rows: list[int]) -> tuple[list[Batch], Normalisers]:
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
                batch = next(data_iterator).to(device)  # noqa: B023 -- called within this step only
                with self.output_rows.only(batch.scored_rows()):
                    logits = model(batch.tokens, batch.position_ids, None, packed_seq_params=batch.packed_seq_params)
                return logits, partial(self._loss_func, batch, denominators, scale)  # noqa: B023 -- as above

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
            merged = _step_metrics(reduced, dp_size)
            # Each micro-batch loss is its share of the mini-batch mean (global normaliser), so the
            # mini-batch loss is their sum over micro-batches and data-parallel ranks.
            merged["train/loss"] = merged["loss/total"]
            merged["train/grad_norm"] = float(grad_norm)
            merged["train/lr"] = float(self.optimizer.param_groups[0]["lr"])
            step_metrics.append(merged)
        self.iteration = iteration
        return {name: float(np.mean([m[name] for m in step_metrics])) for name in step_metrics[0]}

    # -- persistence ---------------------------------------------------------------------------

    def save_hf(self, out_dir: Path, tokenizer: Any) -> dict[str, Any] | None:
        """Write the policy as an HF folder with `tokenizer`'s files (collective); the writing rank
        gets the tensors it wrote."""
        from tasks.megatron.hf_export import save_megatron_as_hf

        return save_megatron_as_hf(self.model.module, self.hf_config, str(out_dir), tokenizer=tokenizer)

    def export_hf(self) -> dict[str, Any] | None:
        """The policy's weights under HF names on the training device, for the writing rank
        (collective; None on the other ranks): views to copy from while the model is not stepped."""
        from tasks.megatron.hf_export import export_hf_state

        return export_hf_state(self.model.module, self.hf_config)

    def save_megatron(self, out_dir: Path, *, iteration: int) -> None:
        """The full training state after `iteration`: weights (fp32 master copies included), Adam's
        moments and step, the LR schedule (`tasks.megatron.full_state`), written before returning."""
        from tasks.megatron import full_state

        full_state.save_now(self.model.module, self.optimizer, self.scheduler, out_dir, iteration=iteration)

    def start_megatron_save(self, out_dir: Path, *, iteration: int, release: Any = None) -> None:
        """The same state staged in host memory and written into `out_dir` by a thread: the model may
        step on; `finish_megatron_save` (collective) completes it. `release` frees `out_dir` once the
        caller has uploaded it."""
        from tasks.megatron import full_state

        if self.pending_full_state is not None:
            raise RuntimeError(
                f"the full state of iteration {self.pending_full_state.iteration} is still being saved; "
                "finish it before saving another"
            )
        self.pending_full_state = full_state.start(
            self.model.module, self.optimizer, self.scheduler, out_dir, iteration=iteration
        )
        if release is not None:
            self.pending_full_state.release = release

    def finish_megatron_save(self) -> Any:
        """The background save in flight, completed (collective; None when there is none): its
        `tasks.megatron.full_state.PendingFullState`, whose folder holds the whole checkpoint."""
        from tasks.megatron import full_state

        pending, self.pending_full_state = self.pending_full_state, None
        if pending is not None:
            full_state.finish(pending)
        return pending

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


def _step_metrics(reduced: list[dict[str, Any]], dp_size: int) -> dict[str, float]:
    """The loss metrics of one optimizer step over all its micro-batches and data-parallel ranks:
    token- (or sample-) weighted means and summed loss shares (`sdpo_core.metrics.combine_metrics`),
    so they do not depend on the micro-batch size or the number of ranks."""
    import torch
    from megatron.core import parallel_state

    from sdpo_core.metrics import combine_metrics

    parts = [
        (
            {k: float(v) for k, v in r.items() if not k.startswith(_COUNT)},
            {k.removeprefix(_COUNT): float(v) for k, v in r.items() if k.startswith(_COUNT)},
        )
        for r in reduced
    ]
    if dp_size > 1:
        gathered: list[Any] = [None] * dp_size
        torch.distributed.all_gather_object(gathered, parts, group=parallel_state.get_data_parallel_group())
        parts = [part for rank_parts in gathered for part in rank_parts]
    return combine_metrics(parts)


# cuBLAS is deterministic on one stream given a fixed workspace; torch refuses its GEMMs under
# deterministic algorithms unless this names one (CUDA >= 10.2)
_CUBLAS_WORKSPACE = ":4096:8"


@contextlib.contextmanager
def deterministic_kernels(enabled: bool) -> Iterator[None]:
    """Run the block with torch's deterministic algorithms when `enabled` (and as before after it).

    On a GPU the attention backward (cuDNN's, flash's) sums its partial gradients in whatever order
    its thread blocks finish, so the same iteration trained twice parts in the last bits and a
    replayed iteration cannot reproduce the weights it committed (`tasks.megatron.resume`). Under
    deterministic algorithms those kernels take their fixed-order paths, and an op that has none
    raises instead of silently varying. Only the training step runs so: sampling and scoring are
    forward passes, deterministic as they are.

    The mode's other half, filling every newly allocated tensor with NaN
    (`torch.utils.deterministic.fill_uninitialized_memory`), is off inside the block: it only
    exposes a kernel that reads memory nobody wrote, which no op of the step does (the
    bit-identical restart tests would catch one), and it writes every new tensor once more (27,573
    fills in a step of the tiny benchmark model, 5-6 % of its operators' CPU time:
    benchmarks/deterministic_step.py).
    """
    import torch
    import torch.utils.deterministic

    if not enabled:
        yield
        return
    if torch.cuda.is_available():
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", _CUBLAS_WORKSPACE)
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    # a property of the module's class in torch, which its stubs do not declare
    fill = torch.utils.deterministic
    fill_before = fill.fill_uninitialized_memory  # type: ignore[attr-defined]
    torch.use_deterministic_algorithms(True)
    fill.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        fill.fill_uninitialized_memory = fill_before  # type: ignore[attr-defined]


def seed_training_rng(seed: int, iteration: int) -> None:
    """Seed every RNG training may draw from (torch, numpy, python, Megatron's model-parallel
    tracker) from (seed, iteration, data-parallel rank) alone: an iteration trains the same way
    whether its process trained the previous one, resumed from the store, or replayed."""
    import torch
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as mcore_tp

    rank = parallel_state.get_data_parallel_rank()
    value = int(np.random.SeedSequence([seed, iteration, rank]).generate_state(1)[0])
    torch.manual_seed(value)
    mcore_tp.model_parallel_cuda_manual_seed(value)  # adds the tensor-parallel rank's offset itself
    np.random.seed(value)
    random.seed(value)
