"""The three CPU compute stages of `make bench-trl`'s long size, each alone: sampling, teacher scoring, training.

`rollout` times the embedded engine drawing 8 answers to each of 64 prompts (16-24 random tokens) of
up to `--new-tokens` tokens with top-16 log-probs, on benchmarks/gpu/pipeline_run.py's random-init
tiny Qwen3 (`write_policy`) (the untrained model runs every answer to about the limit). `teacher` times
the Megatron teacher scorer (`MegatronTeacherScorer`, packed 16,384-token rows) on 512 answers of 3/4 to all
of `--new-tokens` tokens behind 20-47-token teacher prompts; `teacher-hf` the same work through the
default in-process HF scorer (`tasks.engines.scorer.score_teacher`). `train` times one optimizer
step of `MegatronTrainer` on 512 synthetic answers of `--new-tokens` tokens (top-16 + tail, packed
4,096-token rows, float32, `train.deterministic` as by default). Medians of `--repeats` after one
warm-up, with the minor page faults per call; the heap tuned as in `sdpo` processes
(`tasks.allocator.keep_freed_heap`) unless `--glibc-defaults`; `--profile` adds the operators' self
CPU time of one more call.

    OMP_NUM_THREADS=2 .venv/bin/python -m benchmarks.cpu_stages rollout|teacher|teacher-hf|train [--repeats 5] [--glibc-defaults] [--profile]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from benchmarks.deterministic_step import step_config, step_inputs
from benchmarks.gpu.pipeline_run import write_policy

VOCAB = 1024


def rollout(new_tokens: int) -> Callable[[], None]:
    from tasks.engines.base import SamplingParams
    from tasks.engines.embedded import EmbeddedEngine

    model_dir = write_policy("tiny", Path(tempfile.mkdtemp(prefix="cpu-stages-")), vocab=VOCAB)
    engine = EmbeddedEngine(str(model_dir), max_batch_size=512)  # float32, as rollout.dtype in bench-trl
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, VOCAB, size=int(rng.integers(16, 25))).tolist() for _ in range(64)]
    params = SamplingParams(
        n=8, temperature=1.0, top_p=1.0, max_new_tokens=new_tokens, stop_token_ids=[1], top_k_logprobs=16, seed=0
    )
    return lambda: engine._sample(prompts, params, progress=False)


def train(new_tokens: int) -> Callable[[], None]:
    from tasks.megatron.trainer import MegatronTrainer

    hf_dir, columns = step_inputs(shape="tiny", vocab=VOCAB, response=new_tokens)
    trainer = MegatronTrainer(step_config(deterministic=True), hf_dir, load_weights=False)
    iteration = iter(range(1, 10_000))
    return lambda: trainer.train_iteration(columns, iteration=next(iteration))


def _teacher_work(new_tokens: int) -> tuple[Path, list[tuple[list[int], list[int]]], list[np.ndarray]]:
    model_dir = write_policy("tiny", Path(tempfile.mkdtemp(prefix="cpu-stages-")), vocab=VOCAB)
    rng = np.random.default_rng(0)
    # as the long size's teacher shards: ~33-token teacher prompts (the question and the verifier's
    # feedback), answers of 3/4 to all of `new_tokens` tokens
    sequences = [
        (rng.integers(3, VOCAB, size=int(rng.integers(20, 48))).tolist(), rng.integers(3, VOCAB, size=n).tolist())
        for n in rng.integers(new_tokens * 3 // 4, new_tokens + 1, size=512)
    ]
    topk = [rng.integers(0, VOCAB, size=(len(r), 16)) for _, r in sequences]
    return model_dir, sequences, topk


def teacher(new_tokens: int) -> Callable[[], None]:
    from tasks.megatron.scorer import MegatronTeacherScorer

    model_dir, sequences, topk = _teacher_work(new_tokens)
    scorer = MegatronTeacherScorer.from_hf(model_dir, dtype=torch.float32)
    return lambda: scorer.score(sequences=sequences, topk_ids=topk, batch_tokens=16384)


def teacher_hf(new_tokens: int) -> Callable[[], None]:
    from transformers import AutoModelForCausalLM

    from tasks.engines.scorer import score_teacher

    model_dir, sequences, topk = _teacher_work(new_tokens)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return lambda: score_teacher(model, sequences=sequences, topk_ids=topk, batch_tokens=16384)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=["rollout", "teacher", "teacher-hf", "train"])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--glibc-defaults", action="store_true", help="leave malloc's thresholds moving")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if not args.glibc_defaults:
        from tasks.allocator import keep_freed_heap

        keep_freed_heap()
    stages = {"rollout": rollout, "teacher": teacher, "teacher-hf": teacher_hf, "train": train}
    call = stages[args.stage](args.new_tokens)
    call()  # warm-up
    seconds = []
    cpu = []
    faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(args.repeats):
        started, used = time.perf_counter(), time.process_time()
        call()
        seconds.append(time.perf_counter() - started)
        cpu.append(time.process_time() - used)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before) / args.repeats
    runs = " ".join(f"{s:.2f}" for s in seconds)
    heap = "glibc defaults" if args.glibc_defaults else "heap kept"
    print(
        f"{args.stage}: median {statistics.median(seconds):.2f} s ({runs}), {torch.get_num_threads()} threads, "
        f"CPU {statistics.median(cpu):.2f} s, {faults:,.0f} minor page faults per call ({heap})"
    )
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as trace:
            call()
        print(trace.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
