"""Training and teacher-scoring throughput of the Megatron path on Qwen3 shapes (random init, bf16).

Training runs the real `tasks.megatron.trainer.MegatronTrainer.train_iteration` (SDPA attention, chunked and
compiled top-K loss, Megatron DDP and optimizer step) on synthetic teacher columns: each step is
`--samples` sequences of `--seq` tokens (prompt 1/8, response 7/8), top-K = `--k`. Variants:
padded micro-batches, and the same samples packed into one row; each with `train.fused_kernels`
off and/or on (`--fused false true`; scoring uses the last), and `train.deterministic` off and/or on
(`--deterministic false true`: torch's deterministic algorithms, the fixed-order attention backward
among them). MFU counts 6N + 6 L S d_q per
token against 989 TFLOP/s (N without the input embedding).

Scoring runs `tasks.megatron.scorer.MegatronTeacherScorer.score` (packed rows, log-probs on K+1
ids) and the bare forward for comparison.

    python benchmarks/gpu/model_throughput.py --shapes 0.6b 1.7b
"""

from __future__ import annotations

import argparse
import gc
import itertools
import tempfile
from pathlib import Path

import numpy as np
import torch

from benchmarks.gpu.common import (
    DEVICE,
    PEAK_BF16_FLOPS,
    cuda_time,
    emit,
    environment,
    flops_per_token,
    gib,
    median,
    peak,
    qwen3_config,
    reset_peak,
)


def synthetic_columns(*, samples: int, seq: int, k: int, vocab: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    prompt_len = seq // 8
    resp_len = seq - prompt_len
    cols: dict[str, list] = {
        name: []
        for name in (
            "sample_id",
            "prompt_ids",
            "response_ids",
            "topk_ids",
            "teacher_topk_logprobs",
            "teacher_sampled_logprobs",
            "sampled_logprobs",
            "advantage",
            "sample_mask",
            "route",
            "pass_rate",
            "teacher_entropy",
        )
    }
    for i in range(samples):
        cols["sample_id"].append(i)
        cols["prompt_ids"].append(rng.integers(0, vocab, size=prompt_len).tolist())
        cols["response_ids"].append(rng.integers(0, vocab, size=resp_len).tolist())
        cols["topk_ids"].append(rng.integers(0, vocab, size=(resp_len, k)).astype(np.int32))
        cols["teacher_topk_logprobs"].append((-rng.exponential(3.0, size=(resp_len, k)) - 5).astype(np.float32))
        cols["teacher_sampled_logprobs"].append(np.full(resp_len, -12.0, dtype=np.float32))
        cols["sampled_logprobs"].append(np.full(resp_len, -12.0, dtype=np.float32))
        cols["advantage"].append(float(rng.normal()))
        cols["sample_mask"].append(True)
        cols["route"].append(None)
        cols["pass_rate"].append(0.5)
        cols["teacher_entropy"].append(np.full(resp_len, 1.0, dtype=np.float32))
    return cols


def run_config(*, samples: int, micro_batch: int, train: dict, steps: int = 1) -> object:
    """One iteration of `samples` rows split into `steps` optimizer steps."""
    from tasks.config import build_config

    return build_config(
        {
            "iterations": 1000,
            "model": {"dtype": "bfloat16" if DEVICE == "cuda" else "float32"},  # Megatron's bf16 optimizer is CUDA-only
            "data": {"prompts_per_iteration": 1},
            "rollout": {"group_size": samples},
            "train": {"steps_per_iteration": steps, "micro_batch_size": micro_batch, **train},
            "loss": {"type": "sdpo", "divergence": "topk_tail"},
            "optimizer": {"lr": 1e-6, "grad_clip": 1.0},
        }
    )


def bench_train(shape: str, args: argparse.Namespace, workdir: Path) -> None:
    from tasks.megatron.trainer import MegatronTrainer

    hf_config = qwen3_config(shape)
    hf_dir = workdir / shape
    hf_config.save_pretrained(hf_dir)
    steps = args.steps_per_iteration
    columns = synthetic_columns(
        samples=args.samples * steps, seq=args.seq, k=args.k, vocab=hf_config.vocab_size, seed=0
    )
    tokens = args.samples * args.seq  # per optimizer step
    for fused, deterministic in itertools.product(args.fused, args.deterministic):
        base = {
            "attention": "sdpa",
            "loss_chunk_tokens": 1024,
            "loss_compile": DEVICE == "cuda",
            "fused_kernels": fused,
            "deterministic": deterministic,
        }
        cfg = run_config(samples=args.samples * steps, micro_batch=args.micro_batch, train=base, steps=steps)
        trainer = MegatronTrainer(cfg, hf_dir, load_weights=False)
        per_token, n = flops_per_token(trainer.model.module, hf_config, seq_len=args.seq, training=True)
        variants = {
            "padded": base,
            "packed": {**base, "packing": True, "pack_tokens": args.samples * args.seq},
        }
        for name, train in variants.items():
            trainer.cfg = run_config(
                samples=args.samples * steps, micro_batch=args.micro_batch, train=train, steps=steps
            )
            losses = []
            step = [0]

            def one() -> None:
                step[0] += 1
                losses.append(trainer.train_iteration(columns, iteration=step[0])["train/loss"])

            reset_peak()
            times = [x / steps for x in cuda_time(one, warmup=args.warmup, repeat=args.iterations)]
            t = median(times)
            emit(
                {
                    "bench": "train",
                    "shape": shape,
                    "variant": name,
                    "fused_kernels": fused,
                    "deterministic": deterministic,
                    "tokens_per_step": tokens,
                    "steps_per_iteration": steps,
                    "micro_batch": args.micro_batch,
                    "seq": args.seq,
                    "k": args.k,
                    "params_no_embedding": n,
                    "step_s_median": round(t, 4),
                    "step_s_min": round(min(times), 4),
                    "step_s_max": round(max(times), 4),
                    "tokens_per_s": round(tokens / t),
                    "tflops": round(per_token * tokens / t / 1e12, 1),
                    "mfu": round(per_token * tokens / t / PEAK_BF16_FLOPS, 4),
                    "peak_gib": round(gib(peak()), 1),
                    "loss_first_last": [round(losses[0], 5), round(losses[-1], 5)],
                }
            )
        del trainer
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def bench_score(shape: str, args: argparse.Namespace) -> None:
    from tasks.megatron.model import build_gpt_model
    from tasks.megatron.parallel import init_parallel
    from tasks.megatron.scorer import MegatronTeacherScorer

    init_parallel(tensor_parallel=1, seed=0)
    hf_config = qwen3_config(shape)
    fused = args.fused[-1]
    model = build_gpt_model(
        hf_config, params_dtype=torch.bfloat16, parallel_output=True, attention="sdpa", fused_kernels=fused
    )
    scorer = MegatronTeacherScorer(model, vocab_size=hf_config.vocab_size)
    rng = np.random.default_rng(1)
    prompt_len = args.seq // 4
    sequences, topk = [], []
    for _ in range(args.samples):
        sequences.append(
            (
                rng.integers(0, hf_config.vocab_size, prompt_len).tolist(),
                rng.integers(0, hf_config.vocab_size, args.seq - prompt_len).tolist(),
            )
        )
        topk.append(rng.integers(0, hf_config.vocab_size, (args.seq - prompt_len, args.k)))
    tokens = args.samples * args.seq
    per_token, _ = flops_per_token(model, hf_config, seq_len=args.seq, training=False)

    def score() -> None:
        scorer.score(sequences=sequences, topk_ids=topk, batch_tokens=tokens, logit_chunk_tokens=2048)

    ids = torch.from_numpy(np.asarray([p + r for p, r in sequences])).to(DEVICE)
    positions = torch.arange(args.seq, device=DEVICE).expand(args.samples, args.seq)

    @torch.no_grad()
    def forward() -> None:
        model(ids, positions, None)

    reset_peak()
    for name, fn in (("forward_only_padded", forward), ("score_packed_topk", score)):
        times = cuda_time(fn, warmup=2, repeat=args.steps)
        t = median(times)
        emit(
            {
                "bench": "score",
                "shape": shape,
                "variant": name,
                "fused_kernels": fused,
                "tokens": tokens,
                "seq": args.seq,
                "k": args.k,
                "s_median": round(t, 4),
                "tokens_per_s": round(tokens / t),
                "tflops": round(per_token * tokens / t / 1e12, 1),
                "mfu": round(per_token * tokens / t / PEAK_BF16_FLOPS, 4),
                "peak_gib": round(gib(peak()), 1),
            }
        )
    del model, scorer
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=["0.6b", "1.7b"])
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations (training)")
    parser.add_argument("--iterations", type=int, default=4, help="timed iterations (training)")
    parser.add_argument(
        "--steps-per-iteration",
        type=int,
        default=4,
        help="optimizer steps of --samples x --seq tokens per timed train_iteration call",
    )
    parser.add_argument("--steps", type=int, default=6, help="timed calls (scoring)")
    parser.add_argument(
        "--fused",
        nargs="+",
        type=lambda v: v == "true",
        default=[DEVICE == "cuda"],
        help="train.fused_kernels settings to build and time, e.g. --fused false true (GPU only)",
    )
    parser.add_argument(
        "--deterministic",
        nargs="+",
        type=lambda v: v == "true",
        default=[True],
        help="train.deterministic settings to time, e.g. --deterministic false true",
    )
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--skip-score", action="store_true")
    args = parser.parse_args()
    emit({"bench": "environment", **environment()})
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            if not args.skip_train:
                bench_train(shape, args, Path(tmp))
            if not args.skip_score:
                bench_score(shape, args)


if __name__ == "__main__":
    main()
