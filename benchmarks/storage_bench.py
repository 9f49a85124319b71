"""Storage benchmark: top-K layout candidates, shard write/read throughput on local disk and S3, the
teacher stage's shard write.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/storage_bench.py            # 20k samples x 256 tokens x K=16
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/storage_bench.py --part teacher   # part 3 alone

Part 1 compares per-token top-K layouts on realistic synthetic rows (storage.synthetic) and prints the
bytes per response token of the top-K columns. Part 2 writes and reads a whole stage through
`storage` (ShardWriter -> manifest -> read_batches with sha256 checks -> numpy) to file:// and to a
local moto S3 server (a separate process, so it does not share our GIL), `--repeats` times, and
prints medians. MB/s counts bytes as stored (compressed Parquet), MB = 10^6 bytes. Part 3 writes the
teacher stage of the GPU benchmark's size (64 prompts x 8 answers x 384-512 tokens, K=16) on file://
over a committed rollout stage, as `tasks.teacher` does (`write_shards`, its `teacher/write_seconds`),
then reads it back joined (`read_stage_columns` of the trainer's columns, sha256 checks on), and
prints the medians and the bytes of each shard.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from storage import (
    ROLLOUT,
    TEACHER,
    RunLayout,
    ShardWriter,
    StageOutput,
    create_or_open_run,
    ragged,
    read_batches,
    read_stage_columns,
    topk,
    write_shards,
)
from storage.synthetic import synthetic_columns, synthetic_topk
from tasks.megatron.batches import TRAIN_COLUMNS  # what the train stage reads from the teacher stage

REGION = "eu-west-1"
CHUNK_ROWS = 1000


# -- part 1: layout candidates ------------------------------------------------------------------
def _layout_table(ids: np.ndarray, logprobs: np.ndarray, rows: int, *, layout: str) -> pa.Table:
    n_tokens, k = ids.shape
    tokens = n_tokens // rows
    offsets = pa.array(np.arange(0, n_tokens + 1, tokens, dtype=np.int32))
    inner = pa.array(np.arange(0, n_tokens * k + 1, k, dtype=np.int32))
    columns = {}
    for name, values in (("topk_ids", ids), ("topk_logprobs", logprobs)):
        flat = pa.array(values.reshape(-1))
        if layout == "nested":
            columns[name] = pa.ListArray.from_arrays(offsets, pa.ListArray.from_arrays(inner, flat))
        elif layout == "fixed":
            columns[name] = pa.ListArray.from_arrays(offsets, pa.FixedSizeListArray.from_arrays(flat, k))
        else:
            columns[name] = pa.ListArray.from_arrays(pa.array(np.asarray(offsets) * k), flat)
    return pa.table(columns)


def layout_candidates(*, rows: int, tokens: int, k: int, vocab: int) -> list[dict[str, Any]]:
    ids, logprobs = synthetic_topk(rows * tokens, k, vocab=vocab, rng=np.random.default_rng(1))
    bss_leaf = {"nested": "list.element.list.element", "fixed": "list.element.list.element", "flat": "list.element"}
    candidates = []
    labels = (("nested", "list<list<K>>"), ("fixed", "list<fixed_size_list<K>>"), ("flat", "flat list<T*K>"))
    for layout, label in labels:
        for dtype in ("float32", "float16"):
            candidates.append((f"{label}, zstd, pyarrow defaults", layout, dtype, {"compression": "zstd"}))
            encoding = {f"{c}.{bss_leaf[layout]}": "BYTE_STREAM_SPLIT" for c in ("topk_ids", "topk_logprobs")}
            options = {
                "compression": "zstd",
                "compression_level": 1,
                "use_dictionary": False,
                "column_encoding": encoding,
            }
            chosen = " (chosen)" if layout == "fixed" else ""
            candidates.append((f"{label}, zstd(1) + BYTE_STREAM_SPLIT{chosen}", layout, dtype, options))
    for level in (3, 9):
        encoding = {f"{c}.list.element.list.element": "BYTE_STREAM_SPLIT" for c in ("topk_ids", "topk_logprobs")}
        options = {
            "compression": "zstd",
            "compression_level": level,
            "use_dictionary": False,
            "column_encoding": encoding,
        }
        candidates.append((f"list<fixed_size_list<K>>, zstd({level}) + BYTE_STREAM_SPLIT", "fixed", "float32", options))
    results = []
    for label, layout, dtype, options in candidates:
        table = _layout_table(ids, logprobs.astype(dtype), rows, layout=layout)
        sink = io.BytesIO()
        started = time.perf_counter()
        pq.write_table(table, sink, row_group_size=256, **options)
        write_s = time.perf_counter() - started
        data = sink.getvalue()
        started = time.perf_counter()
        pq.read_table(pa.BufferReader(data))
        read_s = time.perf_counter() - started
        metadata = pq.ParquetFile(pa.BufferReader(data)).metadata
        per_column: dict[str, int] = {}
        for g in range(metadata.num_row_groups):
            for c in range(metadata.num_columns):
                chunk = metadata.row_group(g).column(c)
                name = chunk.path_in_schema.split(".")[0]
                per_column[name] = per_column.get(name, 0) + chunk.total_compressed_size
        n_tokens = rows * tokens
        results.append(
            {
                "layout": label,
                "logprobs": dtype,
                "ids_b_per_token": per_column["topk_ids"] / n_tokens,
                "logprobs_b_per_token": per_column["topk_logprobs"] / n_tokens,
                "b_per_token": sum(per_column.values()) / n_tokens,
                "write_s": write_s,
                "read_s": read_s,
            }
        )
    return results


# -- part 2: throughput through storage ----------------------------------------------------------
def make_batches(*, samples: int, tokens: int, k: int, vocab: int) -> list[dict[str, Any]]:
    batches = []
    for start in range(0, samples, CHUNK_ROWS):
        rows = min(CHUNK_ROWS, samples - start)
        batches.append(
            synthetic_columns(
                iteration=0,
                n_rows=rows,
                top_k=k,
                rng=np.random.default_rng(start),
                response_len=(tokens, tokens),
                vocab=vocab,
                first_sample_id=start,
            )
        )
    return batches


def write_stage(layout: RunLayout, batches: list[dict[str, Any]], *, k: int) -> dict[str, Any]:
    create_or_open_run(layout, {"bench": True})
    output = StageOutput(layout, 0, "rollout")
    with ShardWriter(output, ROLLOUT, top_k=k) as writer:
        for columns in batches:
            writer.write(columns)
    return output.commit().data


def read_stage(layout: RunLayout) -> int:
    tokens = 0
    for batch in read_batches(layout, 0, "rollout"):
        ids, offsets = topk(batch, "topk_ids")
        logprobs, _ = topk(batch, "topk_logprobs")
        response = ragged(batch, "response_ids")
        tokens += ids.shape[0]
        assert logprobs.shape == ids.shape and response.values.shape[0] == ids.shape[0]
    return tokens


def bench_backend(
    name: str,
    make_layout: Callable[[], RunLayout],
    batches: list[dict[str, Any]],
    *,
    k: int,
    repeats: int,
    expected_tokens: int,
) -> dict[str, Any]:
    writes, reads, manifest = [], [], None
    for i in range(repeats):
        layout = make_layout()
        started = time.perf_counter()
        manifest = write_stage(layout, batches, k=k)
        writes.append(time.perf_counter() - started)
        started = time.perf_counter()
        tokens = read_stage(layout)
        reads.append(time.perf_counter() - started)
        assert tokens == expected_tokens, (tokens, expected_tokens)
        layout.store.remove_tree(layout.run_url)
        print(f"  {name} repeat {i + 1}/{repeats}: write {writes[-1]:.2f}s, read {reads[-1]:.2f}s", flush=True)
    assert manifest is not None
    stored = manifest["bytes"]
    topk_bytes = sum(f["column_bytes"]["topk_ids"] + f["column_bytes"]["topk_logprobs"] for f in manifest["files"])
    response_tokens = sum(f["response_tokens"] for f in manifest["files"])
    return {
        "backend": name,
        "stored_mb": stored / 1e6,
        "files": len(manifest["files"]),
        "write_s": statistics.median(writes),
        "read_s": statistics.median(reads),
        "write_mb_s": stored / 1e6 / statistics.median(writes),
        "read_mb_s": stored / 1e6 / statistics.median(reads),
        "topk_b_per_token": topk_bytes / response_tokens,
        "row_b_per_token": stored / response_tokens,
        "writes": writes,
        "reads": reads,
    }


# -- part 3: the teacher stage's shard write ------------------------------------------------------
def teacher_write(*, prompts: int, answers: int, tokens: int, k: int, vocab: int, repeats: int) -> dict[str, Any]:
    """Median seconds of the teacher stage's `write_shards` and of a joined read of the trainer's
    columns, and the bytes of each stage's shards."""
    columns = synthetic_columns(
        iteration=1,
        n_rows=prompts * answers,
        top_k=k,
        rng=np.random.default_rng(0),
        response_len=(tokens * 3 // 4, tokens),
        vocab=vocab,
        group_size=answers,
        teacher=True,
    )
    rollout_columns = {c: columns[c] for c in ROLLOUT.names}
    teacher_columns = {c: columns[c] for c in TEACHER.names}  # what this code's teacher shards store
    writes, write_cpus, reads, read_cpus = [], [], [], []
    scratch = Path(tempfile.mkdtemp(prefix="storage-bench-teacher-"))
    try:
        for i in range(repeats + 1):  # the first is a warm-up
            layout = RunLayout(str(scratch), f"teacher-{i}")
            create_or_open_run(layout, {"bench": True})
            rollout = write_shards(layout, 1, "rollout", rollout_columns).commit()
            started, cpu_started = time.perf_counter(), time.process_time()
            output = write_shards(layout, 1, "teacher", teacher_columns)
            written, written_cpu = time.perf_counter() - started, time.process_time() - cpu_started
            teacher = output.commit(parents=[rollout])
            started, cpu_started = time.perf_counter(), time.process_time()
            read = read_stage_columns(layout, 1, "teacher", columns=TRAIN_COLUMNS)
            read_s, read_cpu = time.perf_counter() - started, time.process_time() - cpu_started
            assert len(read["response_ids"]) == prompts * answers
            if i:
                writes.append(written)
                write_cpus.append(written_cpu)
                reads.append(read_s)
                read_cpus.append(read_cpu)
    finally:
        shutil.rmtree(scratch)
    return {
        "rows": prompts * answers,
        "response_tokens": int(columns["response_ids"].offsets[-1]),
        "teacher_columns": len(TEACHER.names),
        "write_s": statistics.median(writes),
        "write_cpu_s": statistics.median(write_cpus),
        "read_s": statistics.median(reads),
        "read_cpu_s": statistics.median(read_cpus),
        "teacher_bytes": [f["bytes"] for f in teacher.data["files"]],
        "rollout_bytes": [f["bytes"] for f in rollout.data["files"]],
        "writes": writes,
        "reads": reads,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return process, f"http://127.0.0.1:{port}"
        time.sleep(0.1)
    process.kill()
    raise RuntimeError("moto server did not start within 30 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--tokens", type=int, default=256, help="response tokens per sample")
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layout-samples", type=int, default=1000)
    parser.add_argument("--skip-s3", action="store_true")
    parser.add_argument("--part", choices=["all", "layouts", "throughput", "teacher"], default="all")
    parser.add_argument("--teacher-prompts", type=int, default=64)
    parser.add_argument("--teacher-answers", type=int, default=8)
    parser.add_argument("--teacher-tokens", type=int, default=512, help="longest answer of part 3")
    parser.add_argument("--teacher-repeats", type=int, default=5)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.part in ("all", "layouts"):
        print_layouts(args)
    if args.part in ("all", "throughput"):
        print_throughput(args)
    if args.part in ("all", "teacher"):
        print_teacher_write(args)
    print(f"\nmachine: {os.cpu_count()} CPUs, python {sys.version.split()[0]}, pyarrow {pa.__version__}")


def print_teacher_write(args: argparse.Namespace) -> None:
    r = teacher_write(
        prompts=args.teacher_prompts,
        answers=args.teacher_answers,
        tokens=args.teacher_tokens,
        k=args.top_k,
        vocab=args.vocab,
        repeats=args.teacher_repeats,
    )
    print(
        f"\n# part 3: the teacher stage's shard write, {args.teacher_prompts} prompts x {args.teacher_answers} answers "
        f"x {args.teacher_tokens * 3 // 4}-{args.teacher_tokens} tokens ({r['response_tokens']} tokens) x "
        f"K={args.top_k}, file://, {args.teacher_repeats} repeats after a warm-up, medians"
    )
    print(
        "| teacher columns stored | write s | write CPU s | joined read of the trainer's columns s | its CPU s "
        "| teacher shard bytes | rollout shard bytes |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {r['teacher_columns']} | {r['write_s']:.3f} | {r['write_cpu_s']:.3f} | {r['read_s']:.3f} | "
        f"{r['read_cpu_s']:.3f} | {sum(r['teacher_bytes']):,} | {sum(r['rollout_bytes']):,} |"
    )
    writes, reads = [round(x, 3) for x in r["writes"]], [round(x, 3) for x in r["reads"]]
    print(f"writes {writes} s, reads {reads} s; teacher shards {r['teacher_bytes']} B")


def print_layouts(args: argparse.Namespace) -> None:
    print(
        f"# part 1: top-K layouts ({args.layout_samples} samples x {args.tokens} tokens x K={args.top_k}, "
        f"vocab {args.vocab}, row groups of 256 samples)",
        flush=True,
    )
    print("| layout | logprobs | ids B/token | logprobs B/token | top-K B/token | write s | read s |")
    print("|---|---|---|---|---|---|---|")
    for r in layout_candidates(rows=args.layout_samples, tokens=args.tokens, k=args.top_k, vocab=args.vocab):
        print(
            f"| {r['layout']} | {r['logprobs']} | {r['ids_b_per_token']:.1f} | {r['logprobs_b_per_token']:.1f} | "
            f"**{r['b_per_token']:.1f}** | {r['write_s']:.2f} | {r['read_s']:.2f} |",
            flush=True,
        )


def print_throughput(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    batches = make_batches(samples=args.samples, tokens=args.tokens, k=args.top_k, vocab=args.vocab)
    expected_tokens = args.samples * args.tokens
    print(
        f"\n# part 2: {args.samples} samples x {args.tokens} tokens x K={args.top_k} through storage "
        f"(generated in {time.perf_counter() - started:.1f}s), {args.repeats} repeats, medians",
        flush=True,
    )
    results = []
    scratch = Path(tempfile.mkdtemp(prefix="storage-bench-"))
    try:
        results.append(
            bench_backend(
                "file://",
                lambda: RunLayout(str(scratch), f"bench-{uuid.uuid4().hex[:8]}"),
                batches,
                k=args.top_k,
                repeats=args.repeats,
                expected_tokens=expected_tokens,
            )
        )
        if not args.skip_s3:
            import boto3

            process, endpoint = start_moto()
            try:
                options = {
                    "endpoint_url": endpoint,
                    "key": "bench",
                    "secret": "bench",
                    "client_kwargs": {"region_name": REGION},
                }
                boto3.client(
                    "s3",
                    endpoint_url=endpoint,
                    region_name=REGION,
                    aws_access_key_id="bench",
                    aws_secret_access_key="bench",
                ).create_bucket(Bucket="bench", CreateBucketConfiguration={"LocationConstraint": REGION})
                results.append(
                    bench_backend(
                        "s3:// (moto)",
                        lambda: RunLayout("s3://bench/runs", f"bench-{uuid.uuid4().hex[:8]}", storage_options=options),
                        batches,
                        k=args.top_k,
                        repeats=args.repeats,
                        expected_tokens=expected_tokens,
                    )
                )
            finally:
                process.terminate()
                process.wait(timeout=30)
    finally:
        shutil.rmtree(scratch)

    print(
        "\n| backend | stored MB | files | write s | write MB/s | read+verify s | read MB/s | top-K B/token "
        "| all columns B/token |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['backend']} | {r['stored_mb']:.0f} | {r['files']} | {r['write_s']:.2f} | {r['write_mb_s']:.0f} | "
            f"{r['read_s']:.2f} | {r['read_mb_s']:.0f} | **{r['topk_b_per_token']:.1f}** | "
            f"{r['row_b_per_token']:.1f} |"
        )
    for r in results:
        writes, reads = [round(x, 2) for x in r["writes"]], [round(x, 2) for x in r["reads"]]
        print(f"{r['backend']}: writes {writes} s, reads {reads} s")


if __name__ == "__main__":
    main()
