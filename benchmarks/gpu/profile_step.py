"""Where a training step's time goes: step time per fused-kernel setting, and a kernel profile.

Builds `tasks.megatron.trainer.MegatronTrainer` on a Qwen3 shape (random init, bf16, SDPA, chunked compiled
loss) twice: with `train.fused_kernels: false` (Megatron's fallbacks) and `true`. The second one's
model-side fusions are Megatron config flags read at every forward, so they are switched one by
one on the same model to attribute the gain (the others, fused AdamW, the device gradient norm,
the fused weight-gradient accumulation and the batch-first logits, stay on in that build); then the all-fused step at other micro-batch sizes. Each
timed call is one `train_iteration` of `--steps-per-iteration` optimizer steps, and figures are
per step. Each setting: 1 warm-up + `--iterations` timed iterations, median; with `--profile`,
one more profiled iteration whose CUDA kernel time is summed by category.

    python benchmarks/gpu/profile_step.py --shape 1.7b --profile
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.gpu.common import (
    DEVICE,
    PEAK_BF16_FLOPS,
    cuda_time,
    emit,
    environment,
    flops_per_token,
    gib,
    kernel_category,
    median,
    peak,
    qwen3_config,
    reset_peak,
)
from benchmarks.gpu.model_throughput import run_config, synthetic_columns
from tasks.megatron.fusions import CompiledRMSNorm

categorise = kernel_category


COPY_OPS = {
    "aten::copy_",
    "aten::contiguous",
    "aten::clone",
    "aten::cat",
    "aten::index_put_",
    "aten::index_copy_",
    "aten::fill_",
    "aten::zero_",
    "aten::add_",
}


def profile_one(step, label: str, top: int, *, stacks: bool, steps: int) -> None:
    """Kernel time of one iteration, per optimizer step, by category (and the GPU's idle time within the step); with
    `stacks`, also the copy-like torch ops with the most device time and the code that called them."""
    import time

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if stacks else [])
    torch.cuda.synchronize()
    with profile(activities=activities, record_shapes=stacks, with_stack=stacks) as prof:
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
    by_cat: dict[str, float] = defaultdict(float)
    kernels = []
    for event in prof.key_averages():
        device_us = event.self_device_time_total
        if device_us <= 0 or event.key.startswith("aten::") or event.key.startswith("cuda"):
            continue
        by_cat[categorise(event.key)] += device_us / steps
        kernels.append((device_us / steps, event.count // steps, event.key))
    total = sum(by_cat.values())
    emit(
        {
            "bench": "profile",
            "setting": label,
            "kernel_ms_total": round(total / 1e3, 2),
            "profiled_step_wall_ms": round(wall_ms, 1),
            "by_category_ms": {k: round(v / 1e3, 2) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        }
    )
    for device_us, count, name in sorted(kernels, reverse=True)[:top]:
        print(f"  {device_us / 1e3:9.2f} ms  x{count:<5d} [{categorise(name)}] {name[:150]}", flush=True)
    if stacks:
        rows = [e for e in prof.key_averages(group_by_input_shape=True, group_by_stack_n=6) if e.key in COPY_OPS]
        rows.sort(key=lambda e: -e.device_time_total)
        print("  copy-like ops by device time (shapes, calling code):", flush=True)
        for event in rows[:12]:
            print(
                f"  {event.device_time_total / 1e3 / steps:9.2f} ms  x{event.count // steps:<4d} {event.key} "
                f"{str(event.input_shapes)[:120]}"
            )
            for frame in event.stack[:6]:
                print(f"        {frame[:160]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="1.7b")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--iterations", type=int, default=3, help="timed iterations per setting")
    parser.add_argument("--steps-per-iteration", type=int, default=4)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument(
        "--micro-batches",
        type=int,
        nargs="*",
        default=[1, 2],
        help="after the settings, time the all-fused step with these micro-batch sizes",
    )
    args = parser.parse_args()
    emit({"bench": "environment", **environment()})
    hf_config = qwen3_config(args.shape)
    steps = args.steps_per_iteration
    columns = synthetic_columns(
        samples=args.samples * steps, seq=args.seq, k=args.k, vocab=hf_config.vocab_size, seed=0
    )
    tokens = args.samples * args.seq  # per optimizer step
    base = {"attention": "sdpa", "loss_chunk_tokens": 1024, "loss_compile": DEVICE == "cuda"}
    # model-side switches, applied in order: Megatron config flags, then the compiled RMSNorm modules
    switches = ["bias_activation_fusion", "apply_rope_fusion", "bias_dropout_fusion", "compiled_norm"]
    names = [
        "+ compiled SwiGLU",
        "+ compiled RoPE",
        "+ compiled residual add",
        "+ compiled RMSNorm (all: fused_kernels=true)",
    ]
    plans = {
        False: [("fallbacks (fused_kernels=false)", {})],
        True: [
            (
                "fused AdamW, device grad norm, weight-gradient accumulation, batch-first logits",
                dict.fromkeys(switches, False),
            )
        ]
        + [(name, {flag: i < n for i, flag in enumerate(switches)}) for n, name in enumerate(names, start=1)],
    }
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / args.shape
        hf_config.save_pretrained(hf_dir)
        for fused, settings in plans.items():
            from tasks.megatron.trainer import MegatronTrainer

            cfg = run_config(
                samples=args.samples * steps,
                micro_batch=args.samples,
                train={**base, "fused_kernels": fused},
                steps=steps,
            )
            trainer = MegatronTrainer(cfg, hf_dir, load_weights=False)
            per_token, n = flops_per_token(trainer.model.module, hf_config, seq_len=args.seq, training=True)
            config = trainer.model.module.config
            counter = [0]

            def step() -> None:
                counter[0] += 1
                trainer.train_iteration(columns, iteration=counter[0])

            for index, (label, flags) in enumerate(settings):
                for flag, value in flags.items():
                    if flag == "compiled_norm":
                        for module in trainer.model.module.modules():
                            if isinstance(module, CompiledRMSNorm):
                                module.compiled = value
                    else:
                        setattr(config, flag, value)
                reset_peak()
                times = [x / steps for x in cuda_time(step, warmup=1, repeat=args.iterations)]
                t = median(times)
                emit(
                    {
                        "bench": "train_setting",
                        "shape": args.shape,
                        "setting": label,
                        "tokens_per_step": tokens,
                        "step_s_median": round(t, 4),
                        "step_s_min": round(min(times), 4),
                        "step_s_max": round(max(times), 4),
                        "tokens_per_s": round(tokens / t),
                        "mfu": round(per_token * tokens / t / PEAK_BF16_FLOPS, 4),
                        "peak_gib": round(gib(peak()), 1),
                        "params_no_embedding": n,
                    }
                )
                if args.profile:
                    profile_one(step, label, args.top, stacks=fused and index == len(settings) - 1, steps=steps)
            if fused:
                for micro_batch in args.micro_batches:
                    trainer.cfg = run_config(
                        samples=args.samples * steps,
                        micro_batch=micro_batch,
                        train={**base, "fused_kernels": True},
                        steps=steps,
                    )
                    t = median(cuda_time(step, warmup=1, repeat=args.iterations)) / steps
                    emit(
                        {
                            "bench": "train_setting",
                            "shape": args.shape,
                            "setting": f"all fused, micro-batch {micro_batch}",
                            "step_s_median": round(t, 4),
                            "mfu": round(per_token * tokens / t / PEAK_BF16_FLOPS, 4),
                        }
                    )
            del trainer
            gc.collect()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
