"""Rollout throughput through the SGLang client (against the SGLang-API test server) vs the embedded engine.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rollout_client_bench.py            # 3 repeats

Both sides run the same sampler on the same demo-size model (a bootstrap-built Qwen3: hidden 128,
4 layers, the demo config's shape, random weights), so the difference is what the HTTP path costs:
JSON encoding of ids and top-K log-probs, the server's request batching, and the client's
per-call checks (a `/get_model_info` per server before each `generate`). The test server runs in
its own process, as a real server would. Prints medians over `--repeats`:

- rollout tokens/s for the demo rollout (32 prompts x 8 samples x 6 tokens, top-16) and a longer
  one (32 x 8 x 32 tokens);
- per-call latency of a 1-prompt, 1-sample, 1-token `generate` through each engine and of the same
  `/generate` request sent with plain httpx: client minus plain request is the client's own
  overhead per request; client minus embedded is what the whole HTTP path costs.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tasks.config import SGLangConfig  # noqa: E402
from tasks.data.bootstrap_model import build_model, build_tokenizer, prompt_ids  # noqa: E402
from tasks.engines.embedded import EmbeddedEngine  # noqa: E402
from tasks.engines.sglang.client import SGLangEngine  # noqa: E402
from tasks.engines.sglang.weights import checkpoint_weight_version  # noqa: E402

logger = logging.getLogger("rollout_client_bench")

DEMO_SHAPE = dict(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=384, max_positions=256)
WORKLOADS = {  # name: (prompts, group size, max_new_tokens)
    "demo (32 x 8 x 6 tok)": (32, 8, 6),
    "long (32 x 8 x 32 tok)": (32, 8, 32),
}
TOP_K = 16


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def start_server(checkpoint: Path, port: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    command = [
        sys.executable,
        "-m",
        "tests.sglang_server.app",
        "--model-path",
        str(checkpoint),
        "--port",
        str(port),
        "--weight-version",
        checkpoint_weight_version(checkpoint),
        "--log-level",
        "error",
    ]
    return subprocess.Popen(command, cwd=ROOT, env=env)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--latency-calls", type=int, default=30)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "policy"
        tokenizer = build_tokenizer(checkpoint)
        build_model(tokenizer, seed=0, **DEMO_SHAPE).save_pretrained(checkpoint)
        prompts = [prompt_ids(tokenizer, [{"role": "user", "content": f"{a}+{a * 7 % 100}="}]) for a in range(32)]
        stop = [int(tokenizer.eos_token_id)]

        port = free_port()
        server = start_server(checkpoint, port)
        url = f"http://127.0.0.1:{port}"
        try:
            embedded = EmbeddedEngine(str(checkpoint), max_batch_size=64)
            client = SGLangEngine(SGLangConfig(urls=[url], health_timeout_s=120.0, max_concurrency=64), str(checkpoint))
            rows = []
            for name, (num_prompts, group, tokens) in WORKLOADS.items():
                kwargs = dict(
                    n=group,
                    temperature=1.0,
                    top_p=1.0,
                    max_new_tokens=tokens,
                    stop_token_ids=stop,
                    top_k_logprobs=TOP_K,
                    seed=0,
                )
                batch = prompts[:num_prompts]
                out = embedded.generate(batch, **kwargs)  # warm both paths (and the client's log-prob probe)
                client.generate(batch, **kwargs)
                generated = sum(len(g.response_ids) for grp in out for g in grp)
                engines = (("embedded, in-process", embedded), ("SGLang client -> test server", client))
                for engine_name, engine in engines:
                    seconds = statistics.median(
                        timed(lambda e=engine: e.generate(batch, **kwargs)) for _ in range(args.repeats)
                    )
                    rows.append((name, engine_name, generated, seconds, generated / seconds))

            one = dict(
                n=1, temperature=1.0, top_p=1.0, max_new_tokens=1, stop_token_ids=stop, top_k_logprobs=TOP_K, seed=0
            )
            latency = {}
            for engine_name, engine in (("embedded", embedded), ("client", client)):
                engine.generate(prompts[:1], **one)
                latency[engine_name] = statistics.median(
                    timed(lambda e=engine: e.generate(prompts[:1], **one)) for _ in range(args.latency_calls)
                )
            body = {  # what the client sends for that call
                "input_ids": [prompts[0]],
                "sampling_params": [
                    {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 1, "stop_token_ids": stop, "sampling_seed": 0}
                ],
                "return_logprob": True,
                "top_logprobs_num": TOP_K,
                "logprob_start_len": -1,
            }
            with httpx.Client() as http:
                http.get(f"{url}/health")
                http.post(f"{url}/generate", json=body)
                round_trip = statistics.median(
                    timed(lambda: http.get(f"{url}/health")) for _ in range(args.latency_calls)
                )
                latency["raw"] = statistics.median(
                    timed(lambda: http.post(f"{url}/generate", json=body).json()) for _ in range(args.latency_calls)
                )
            client.close()
            embedded.close()
        finally:
            server.terminate()
            server.wait(timeout=30)

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"\nRollout throughput (median of {args.repeats}; top-{TOP_K} log-probs; OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}; {os.cpu_count()} CPUs, load average {load})\n"
    )
    print("| workload | engine | tokens | seconds | tokens/s |")
    print("|---|---|---:|---:|---:|")
    for name, engine_name, generated, seconds, rate in rows:
        print(f"| {name} | {engine_name} | {generated} | {seconds:.3f} | {rate:,.0f} |")
    print(f"\nPer-request latency (median of {args.latency_calls}; 1 prompt x 1 sample x 1 token)\n")
    print("| measure | ms |")
    print("|---|---:|")
    rows_ms = [
        ("embedded engine generate, in-process", latency["embedded"]),
        ("plain POST /generate to the test server (sync httpx, the client's body)", latency["raw"]),
        ("SGLang client generate (version check + /generate + parsing)", latency["client"]),
        ("client's own overhead (client generate - plain POST)", latency["client"] - latency["raw"]),
        ("HTTP path overhead vs in-process (client generate - embedded)", latency["client"] - latency["embedded"]),
        ("bare HTTP round trip (GET /health)", round_trip),
    ]
    for label, seconds in rows_ms:
        print(f"| {label} | {seconds * 1e3:.2f} |")


if __name__ == "__main__":
    main()
