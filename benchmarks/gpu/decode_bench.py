"""The embedded engine's decode on one GPU against its memory-traffic bound.

    python -m benchmarks.gpu.decode_bench --shapes 0.6b 1.7b [--loops static eager] [--rows 512] [--new-tokens 512]

Per shape: a random-init Qwen3 (bf16, the Qwen3 vocabulary, benchmarks/gpu/pipeline_run.py's
policy), `--rows` answers of `--new-tokens` tokens from prompts of 30-60 random ids (top-100
log-probs recorded, temperature 1), sampled by each decode loop (`static`: the captured CUDA-graph
loop, the engine's default on a GPU; `eager`: one forward per step from Python).

The bound: every decode step reads the weights once and every decoding row's KV cache up to its
filled length once (28 layers x 8 KV heads x 128 dims x K and V x 2 bytes = 114,688 bytes a
position on both shapes), at the card's copy bandwidth, measured here first (a device-to-device
copy of 2 GiB, bytes read plus written). Rows of a random-init model never stop, so every step
decodes every row. One `RESULT {json}` line per shape and loop: seconds (median of --repeat
calls after one warm-up), tokens/s, bound seconds and the ratio; and the bounded attention
kernel alone at the mean fill (its achieved bandwidth).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.gpu.common import emit, environment


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy (read + write), median of 10."""
    src = torch.empty(2**30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / statistics.median(times[2:])


def bound_seconds(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, bandwidth: float) -> float:
    """Seconds to read the weights and each row's filled KV cache once per decode step."""
    config = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    lengths = np.array([len(p) for p in prompts])
    total = 0.0
    for step in range(1, new_tokens):  # the first token comes from the prompt's forward
        total += weights + per_position * float((lengths + step).sum())
    return total / bandwidth


def attention_alone(rows: int, fill: int, capacity: int, bandwidth: float) -> dict[str, float]:
    """The bounded decode attention of one layer (8 KV heads, 16 query heads, 128 dims) at `fill`."""
    from tasks.engines.decode_attention import decode_attention

    q = torch.randn(rows, 16, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(rows, 8, capacity, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    start = torch.zeros(rows, dtype=torch.long, device="cuda")
    end = torch.tensor([fill], device="cuda")
    for _ in range(3):
        decode_attention(q, k, v, start, end, 128**-0.5)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        decode_attention(q, k, v, start, end, 128**-0.5)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / 20
    moved = 2 * rows * 8 * fill * 128 * 2
    return {"attention_ms": seconds * 1e3, "attention_gbps": moved / seconds / 1e9, "bound_ms": moved / bandwidth * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["0.6b"])
    parser.add_argument("--loops", nargs="+", default=["static", "eager"])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()

    from benchmarks.gpu.pipeline_run import write_policy
    from tasks.engines.embedded import EmbeddedEngine

    bandwidth = copy_bandwidth()
    emit({"what": "copy_bandwidth", "gbps": bandwidth / 1e9, **environment()})
    rng = np.random.default_rng(0)
    prompts = [rng.integers(200, 10_000, size=int(rng.integers(30, 61))).tolist() for _ in range(args.rows // 8)]
    for shape in args.shapes:
        folder = Path(tempfile.mkdtemp(prefix=f"decode-{shape}-"))
        write_policy(shape, folder)
        for loop in args.loops:
            engine = EmbeddedEngine(
                str(folder), device="cuda", dtype=torch.bfloat16, max_batch_size=args.rows, decode=loop
            )
            bound = bound_seconds(engine.model, [p for p in prompts for _ in range(8)], args.new_tokens, bandwidth)
            times = []
            for attempt in range(args.repeat + 1):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = engine.generate(
                    prompts, n=8, temperature=1.0, top_p=1.0, max_new_tokens=args.new_tokens,
                    stop_token_ids=[], top_k_logprobs=100, seed=attempt,
                )  # fmt: skip
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            tokens = sum(len(g.response_ids) for group in out for g in group)
            seconds = statistics.median(times[1:])
            emit({
                "what": "decode", "shape": shape, "loop": loop, "rows": args.rows, "new_tokens": args.new_tokens,
                "seconds": round(seconds, 3), "first_call_s": round(times[0], 3), "tokens_per_s": round(tokens / seconds),
                "bound_s": round(bound, 3), "over_bound": round(seconds / bound, 2),
                "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
            })  # fmt: skip
            engine.close()
            torch.cuda.empty_cache()
        mean_fill = 45 + args.new_tokens // 2
        emit({"what": "attention_alone", "shape": shape, "rows": args.rows, "fill": mean_fill,
              **attention_alone(args.rows, mean_fill, 60 + args.new_tokens, bandwidth)})  # fmt: skip


if __name__ == "__main__":
    main()
