"""Where a steady GPU iteration's compute goes, stage by stage: the decode step, the draw, the teacher's scoring.

    python -m benchmarks.gpu.iteration_profile --shape 0.6b [--parts decode draw score] [--rows 512]

- `decode`: the embedded engine's captured decode at the pipeline's mean cache fill (prompts of
  `--fill` tokens, so every step reads about as much KV cache as the average step of a 512-token
  answer): seconds per step from two generations that differ only in their length, then one
  profiled generation per loop (captured, eager) with its CUDA kernel time per step by category
  (the prompt's forward taken out by profiling a one-token generation too).
- `draw`: the draw and its records alone (`tasks.engines.sampling.sample_step`) on [rows, V] float32
  logits, and the passes it is made of, each timed alone.
- `score`: the Megatron teacher scorer on the pipeline's teacher work (`--rows` sequences of a
  100-token teacher prompt and a 512-token response, packed in 16,384-token rows, top-100), its
  seconds, MFU and the CUDA kernel time by category, and the GPU's idle share of the call.

One `RESULT {json}` line per measurement; kernel tables as plain lines after their RESULT.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from benchmarks.gpu.common import (
    PEAK_BF16_FLOPS,
    cuda_time,
    emit,
    environment,
    flops_per_token,
    kernel_category,
    median,
    qwen3_config,
)

categorise = kernel_category


def kernel_profile(fn: Callable[[], object]) -> tuple[dict[str, float], dict[str, tuple[float, int]], float]:
    """(ms by category, ms and count by kernel name, wall ms) of one profiled call."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3
    by_cat: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, tuple[float, int]] = {}
    for event in prof.key_averages():
        us = event.self_device_time_total
        if us <= 0 or event.key.startswith(("aten::", "cuda")):
            continue
        by_cat[categorise(event.key)] += us / 1e3
        by_kernel[event.key] = (us / 1e3, event.count)
    return dict(by_cat), by_kernel, wall


def per_step(long: dict, short: dict, steps: int) -> dict[str, float]:
    keys = set(long) | set(short)
    return {k: (long.get(k, 0.0) - short.get(k, 0.0)) / steps for k in keys}


def print_kernels(
    long: dict[str, tuple[float, int]], short: dict[str, tuple[float, int]], steps: int, top: int
) -> None:
    rows = []
    for name, (ms, count) in long.items():
        ms0, count0 = short.get(name, (0.0, 0))
        rows.append(((ms - ms0) / steps, (count - count0) / steps, name))
    for ms, count, name in sorted(rows, reverse=True)[:top]:
        print(f"  {ms:8.3f} ms/step x{count:6.1f} [{categorise(name)}] {name[:140]}", flush=True)


def part_decode(args: argparse.Namespace, folder: Path) -> None:
    from tasks.engines.embedded import EmbeddedEngine

    rng = np.random.default_rng(0)
    prompts = [rng.integers(200, 10_000, size=args.fill).tolist() for _ in range(args.rows // 8)]
    short, long = 2, 2 + args.steps
    for loop in ("static", "eager"):
        engine = EmbeddedEngine(str(folder), device="cuda", dtype=torch.bfloat16, max_batch_size=args.rows, decode=loop)

        def generate(new_tokens: int, engine: EmbeddedEngine = engine) -> None:
            engine.generate(
                prompts, n=8, temperature=1.0, top_p=1.0, max_new_tokens=new_tokens,
                stop_token_ids=[], top_k_logprobs=100, seed=0,
            )  # fmt: skip

        generate(long)  # warm-up: compiles, captures the bucket
        t_short = median(cuda_time(lambda: generate(short), warmup=0, repeat=3))
        t_long = median(cuda_time(lambda: generate(long), warmup=0, repeat=3))
        step_ms = (t_long - t_short) / (long - short) * 1e3
        cat_long, k_long, _ = kernel_profile(lambda: generate(long))
        cat_short, k_short, _ = kernel_profile(lambda: generate(short))
        cats = per_step(cat_long, cat_short, long - short)
        emit({
            "part": "decode", "loop": loop, "rows": args.rows, "fill": args.fill + args.steps // 2,
            "step_ms": round(step_ms, 3), "kernel_ms_per_step": round(sum(cats.values()), 3),
            "by_category_ms": {k: round(v, 3) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        })  # fmt: skip
        print_kernels(k_long, k_short, long - short, args.top)
        engine.close()
        torch.cuda.empty_cache()


def part_draw(args: argparse.Namespace) -> None:
    from tasks.engines.sampling import DecodeOutputs, DrawSettings, sample_step

    vocab = 151_936
    b = args.rows
    logits = torch.randn(b, vocab, device="cuda") * 2.0
    out = DecodeOutputs.allocate(b, 4, 100, torch.device("cuda"))
    settings = DrawSettings(
        uniforms=torch.rand(b, 4, device="cuda"), temperature=1.0, top_p=1.0,
        stop_ids=torch.tensor([0], device="cuda"),
    )  # fmt: skip
    rows = torch.arange(b, device="cuda")
    finished = torch.zeros(b, dtype=torch.bool, device="cuda")
    step = torch.zeros(1, dtype=torch.long, device="cuda")
    bf16 = logits.bfloat16()
    probs = torch.softmax(logits, -1)
    cdf = probs.cumsum(-1)
    target = torch.rand(b, 1, device="cuda")
    passes: dict[str, Callable[[], object]] = {
        "sample_step (all)": lambda: sample_step(
            logits, rows=rows, step=step, finished=finished, settings=settings, out=out
        ),
        "log_softmax f32": lambda: torch.log_softmax(logits, -1),
        "softmax f32": lambda: torch.softmax(logits, -1),
        "cumsum f32": lambda: probs.cumsum(-1),
        "searchsorted": lambda: torch.searchsorted(cdf, target),
        "topk100 f32": lambda: logits.topk(100, dim=-1),
        "topk100 bf16": lambda: bf16.topk(100, dim=-1),
        "logsumexp f32": lambda: torch.logsumexp(logits, -1),
        "argmax f32": lambda: logits.argmax(-1),
        "bf16->f32 copy": lambda: bf16.float(),
    }
    for name, fn in passes.items():
        ms = median(cuda_time(fn, warmup=3, repeat=20)) * 1e3
        emit({"part": "draw", "what": name, "rows": b, "vocab": vocab, "ms": round(ms, 3)})


def part_score(args: argparse.Namespace) -> None:
    from tasks.megatron.model import build_gpt_model
    from tasks.megatron.parallel import init_parallel
    from tasks.megatron.scorer import MegatronTeacherScorer

    init_parallel(tensor_parallel=1, seed=0)
    hf_config = qwen3_config(args.shape)
    model = build_gpt_model(
        hf_config, params_dtype=torch.bfloat16, parallel_output=True, attention="sdpa", fused_kernels=True
    )
    scorer = MegatronTeacherScorer(model, vocab_size=hf_config.vocab_size)
    rng = np.random.default_rng(1)
    prompt, response = 100, 512
    sequences = [
        (
            rng.integers(0, hf_config.vocab_size, prompt).tolist(),
            rng.integers(0, hf_config.vocab_size, response).tolist(),
        )
        for _ in range(args.rows)
    ]
    topk = [rng.integers(0, hf_config.vocab_size, (response, 100)) for _ in range(args.rows)]
    per_token, _ = flops_per_token(model, hf_config, seq_len=prompt + response, training=False)
    tokens = args.rows * (prompt + response)

    def score() -> None:
        scorer.score(sequences=sequences, topk_ids=topk, batch_tokens=16384)

    times = cuda_time(score, warmup=1, repeat=2)
    cats, kernels, wall = kernel_profile(score)
    t = median(times)
    emit({
        "part": "score", "shape": args.shape, "sequences": args.rows, "tokens": tokens, "s_median": round(t, 3),
        "mfu": round(per_token * tokens / t / PEAK_BF16_FLOPS, 4), "profiled_wall_ms": round(wall, 1),
        "kernel_ms": round(sum(cats.values()), 1), "gpu_idle_share": round(1 - sum(cats.values()) / wall, 3),
        "by_category_ms": {k: round(v, 1) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
    })  # fmt: skip
    for name, (ms, count) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"  {ms:9.2f} ms x{count:<5d} [{categorise(name)}] {name[:140]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="0.6b")
    parser.add_argument("--parts", nargs="+", default=["decode", "draw", "score"])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--fill", type=int, default=290, help="prompt tokens: the cache fill the steps read")
    parser.add_argument("--steps", type=int, default=24, help="decode steps between the short and long generation")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    emit({"part": "environment", **environment()})
    if "decode" in args.parts:
        from benchmarks.gpu.pipeline_run import write_policy

        folder = Path(tempfile.mkdtemp(prefix=f"profile-{args.shape}-"))
        write_policy(args.shape, folder)
        part_decode(args, folder)
    if "draw" in args.parts:
        part_draw(args)
    if "score" in args.parts:
        part_score(args)


if __name__ == "__main__":
    main()
