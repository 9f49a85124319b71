"""The GPU pipeline benchmark's work in TRL's `SDPOTrainer` (`trl.experimental.sdpo`), for the ratio.

    python -m benchmarks.gpu.trl_sdpo --shape 0.6b --out /tmp/trl [--iterations 3]

Same model (benchmarks/gpu/pipeline_run.py's random-init Qwen3 and padded demo tokenizer), same
arithmetic prompts (64 a step), G = 8 answers of up to 512 new tokens at temperature 1, top-K 100
distillation with the tail bucket, alpha = 0.5, IS clip 2, EMA teacher (tau 0.05, synced every
step), bf16 weights, no activation checkpointing, lr 1e-6 and one optimizer step per iteration
over all 512 answers (8 per micro-batch, 64 accumulated). The teacher sees the prompt and the verifier's feedback: a random-init model's
answers all hit the length limit, so every prompt carries the arithmetic verifier's TRUNCATED text
as TRL's `privileged_context`, which is what the pipeline's teacher sees for those answers.
Generation is TRL's default (transformers `generate`, no vLLM). Iteration n's seconds are the time
between the ends of optimizer steps n-1 and n (a trainer callback); step 1 counts from the first
call of `train`. Each iteration also reports where its time went: `generate_s` (the trainer's
`_generate`), `teacher_forward_s` (its `_forward_logits` calls without gradients: the teacher's
logits, and the old-policy log-probs when TRL needs them) and `student_forward_s` (those with
gradients); the rest is the backward pass, the loss, the optimizer, rewards and batch building.
Prints one `RESULT {json}` line per iteration as it ends and one for the run.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.gpu.common import SHAPES, VOCAB, emit, gib, peak, reset_peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=100)
    parser.add_argument("--micro-batch", type=int, default=8)
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl.experimental.sdpo import SDPOConfig, SDPOTrainer

    from benchmarks.gpu.pipeline_run import write_policy
    from sdpo_core.verifiers.arithmetic import TRUNCATED, final_answer
    from tasks.config import DataConfig
    from tasks.data.prompts import load_splits

    out = args.out.resolve()
    policy = write_policy(args.shape, out / f"policy-{args.shape}", vocab=args.vocab)
    train_rows, _ = load_splits(DataConfig(), seed=0)
    rows = train_rows[: args.prompts * args.iterations]
    dataset = Dataset.from_list(
        [{"prompt": r["prompt_messages"], "label": r["label"], "privileged_context": TRUNCATED} for r in rows]
    )

    def correct(completions: list, label: list[str], **_: object) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(final_answer(t) == int(y)) for t, y in zip(texts, label, strict=True)]

    samples = args.prompts * args.group
    if samples % args.micro_batch:
        raise ValueError(f"--micro-batch {args.micro_batch} does not divide {samples} answers a step")
    bf16 = torch.cuda.is_available()
    config = SDPOConfig(
        output_dir=str(out / "trl"),
        seed=0,
        max_steps=args.iterations,
        learning_rate=1e-6,
        weight_decay=0.01,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        bf16=bf16,
        gradient_checkpointing=False,  # TRL's default is on; the pipeline does not recompute either
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=samples // args.micro_batch,
        num_generations=args.group,
        max_completion_length=args.new_tokens,
        max_prompt_length=512,
        temperature=1.0,
        top_p=1.0,
        shuffle_dataset=False,
        distillation_weight=1.0,
        distillation_mode="topk_logits",
        distillation_topk=args.top_k,
        distillation_add_tail=True,
        distillation_alpha=0.5,
        distillation_is_clip=2.0,
        teacher_model_kind="ema",
        teacher_update_rate=0.05,
        teacher_sync_steps=1,
        include_environment_feedback=True,
        environment_feedback_only_without_solution=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.bfloat16 if bf16 else torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(policy)

    phases = {"generate_s": 0.0, "teacher_forward_s": 0.0, "student_forward_s": 0.0}

    def timed(method: Any, phase: Callable[[], str]) -> Any:
        def call(*a: Any, **kw: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*a, **kw)
            finally:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                phases[phase()] += time.perf_counter() - started

        return call

    SDPOTrainer._generate = timed(SDPOTrainer._generate, lambda: "generate_s")
    SDPOTrainer._forward_logits = timed(
        SDPOTrainer._forward_logits,
        lambda: "student_forward_s" if torch.is_grad_enabled() else "teacher_forward_s",
    )

    class StepClock(TrainerCallback):
        """One RESULT line per optimizer step as it ends (a run cut short keeps what it measured)."""

        def __init__(self) -> None:
            self.previous = 0.0
            self.seconds: list[float] = []
            self.phases: list[dict[str, float]] = []

        def on_step_end(self, *_: object, **__: object) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            now = time.perf_counter()
            self.seconds.append(now - self.previous)
            self.previous = now
            self.phases.append({k: round(v, 3) for k, v in phases.items()})
            phases.update(dict.fromkeys(phases, 0.0))

        def on_log(
            self, _args: object, _state: object, _control: object, logs: dict | None = None, **__: object
        ) -> None:
            if logs and "loss" in logs:
                emit(
                    {
                        "bench": "trl_iteration",
                        "shape": args.shape,
                        "iteration": len(self.seconds),
                        "wall_s": round(self.seconds[-1], 2),
                        **self.phases[-1],
                        "loss": logs["loss"],
                        "completion_length": logs.get("completions/mean_length"),
                        "peak_allocated_gib": round(gib(peak()), 1),
                    }
                )

    clock = StepClock()
    trainer = SDPOTrainer(
        model=model,
        reward_funcs=correct,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    reset_peak()
    started = clock.previous = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - started
    steady = clock.seconds[1:] or clock.seconds
    emit(
        {
            "bench": "trl",
            "shape": args.shape,
            "train_s": round(total, 1),
            "steady_iterations": len(steady),
            "steady_mean_s": round(sum(steady) / len(steady), 2),
            "peak_allocated_gib": round(gib(peak()), 1),
            "samples_per_step": samples,
            "micro_batch": args.micro_batch,
        }
    )


if __name__ == "__main__":
    main()
