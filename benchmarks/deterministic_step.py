"""What torch's deterministic mode costs the training step, and what its NaN fill of new tensors adds.

Three arms on one trainer, interleaved repeat by repeat: `train.deterministic: false`, the step under
torch's whole deterministic mode (deterministic algorithms plus
`torch.utils.deterministic.fill_uninitialized_memory`, torch's default), and the step as
`train.deterministic: true` runs it (`tasks.megatron.trainer.deterministic_kernels`: the algorithms
without the fill). The work is `make bench-trl`'s long size on its tiny Qwen3 (512 answers of
`--response` tokens, top-16 + tail, one optimizer step, float32, packed 4,096-token rows).

    OMP_NUM_THREADS=2 .venv/bin/python -m benchmarks.deterministic_step [--repeats 5] [--response 256] [--profile]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.utils.deterministic

from benchmarks.gpu.common import DEVICE, qwen3_config
from benchmarks.gpu.model_throughput import synthetic_columns


def step_config(*, deterministic: bool) -> Any:
    from tasks.config import build_config

    cpu = DEVICE == "cpu"
    return build_config(
        {
            "iterations": 1000,
            "model": {"dtype": "float32" if cpu else "bfloat16"},
            "data": {"prompts_per_iteration": 64},
            "rollout": {"group_size": 8, "top_k": 16},
            "train": {
                "steps_per_iteration": 1,
                "attention": "sdpa",
                "packing": True,
                "pack_tokens": 4096,
                "fused_kernels": not cpu,
                "loss_compile": not cpu,
                "loss_chunk_tokens": 0 if cpu else 1024,
                "deterministic": deterministic,
            },
            "loss": {"type": "sdpo", "divergence": "topk_tail"},
            "optimizer": {"lr": 1e-6},
        }
    )


def step_inputs(*, shape: str, vocab: int, response: int) -> tuple[Path, dict[str, Any]]:
    """A config-only HF folder of the `shape` Qwen3 (the trainer initialises it at random) and the
    teacher columns of 512 synthetic answers of `response` tokens, top-16."""
    hf_config = qwen3_config(shape)
    hf_config.vocab_size = vocab
    hf_dir = Path(tempfile.mkdtemp(prefix="training-step-"))
    hf_config.save_pretrained(hf_dir)
    # synthetic_columns gives a prompt of seq // 8 tokens: seq = response * 8 / 7
    columns = synthetic_columns(samples=512, seq=response * 8 // 7, k=16, vocab=vocab, seed=0)
    return hf_dir, columns


def main() -> None:
    from tasks.megatron.trainer import MegatronTrainer, deterministic_kernels

    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--response", type=int, default=256, help="response tokens per answer")
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--profile", action="store_true", help="also trace one step of the whole mode")
    args = parser.parse_args()
    hf_dir, columns = step_inputs(shape=args.shape, vocab=args.vocab, response=args.response)
    configs = {flag: step_config(deterministic=flag) for flag in (False, True)}
    trainer = MegatronTrainer(configs[True], hf_dir, load_weights=False)
    trainer.train_iteration(columns, iteration=1)  # warm-up

    def whole_mode(iteration: int) -> None:
        trainer.cfg = configs[True]
        with deterministic_kernels(True):
            torch.utils.deterministic.fill_uninitialized_memory = True  # torch's default; restored on exit
            trainer._train_iteration(columns, iteration=iteration)

    def setting(deterministic: bool) -> Any:
        def run(iteration: int) -> None:
            trainer.cfg = configs[deterministic]
            trainer.train_iteration(columns, iteration=iteration)

        return run

    arms = {
        "default kernels": setting(False),
        "whole mode (with fill)": whole_mode,
        "train.deterministic": setting(True),
    }
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    iteration = 2
    for _ in range(args.repeats):
        for name, run in arms.items():
            started = time.perf_counter()
            run(iteration)
            seconds[name].append(time.perf_counter() - started)
            iteration += 1
    base = statistics.median(seconds["default kernels"])
    print(f"{args.shape}, 512 answers x {args.response} tokens, {args.repeats} repeats, {DEVICE}")
    print("| arm | median s | runs s | / default kernels |\n|---|---|---|---|")
    for name, values in seconds.items():
        runs = " ".join(f"{v:.2f}" for v in values)
        print(f"| {name} | {statistics.median(values):.2f} | {runs} | {statistics.median(values) / base:.2f} |")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as trace:
            whole_mode(iteration)
        events = trace.key_averages()
        total = sum(event.self_cpu_time_total for event in events)
        (fills,) = [event for event in events if event.key == "aten::fill_"]
        print(
            f"whole mode, one step traced: {fills.count} aten::fill_ calls, "
            f"{fills.self_cpu_time_total / total:.1%} of the operators' self CPU time"
        )


if __name__ == "__main__":
    main()
