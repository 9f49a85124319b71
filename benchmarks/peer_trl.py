"""`sdpo run` beside TRL's `SDPOTrainer` on the same work, on this machine: medians, ratios, peak RSS.

    make bench-trl                       # builds .sdpo/bench-venv (TRL beside this project's venv), runs this
    .sdpo/bench-venv/bin/python benchmarks/peer_trl.py [--sizes small large long] [--pairs 2]

Both sides get the same model folder (benchmarks/gpu/pipeline_run.py's random-init Qwen3 of
`--shape`, float32 here), the same arithmetic prompts, G answers per prompt, the same new-token
limit, top-K 16 + tail, alpha 0.5, EMA teacher (tau 0.05), lr 1e-6 and one optimizer step per
iteration, accumulated over micro-batches: TRL's of 32 answers (8 at the small size), ours packed
to 4096 tokens (8192 at the long size, about the tokens of TRL's padded micro-batch there). Ours is
the CLI (benchmarks/gpu/pipeline.yaml with CPU placement: Prefect flow, shards, manifests, HF and
EMA checkpoints every iteration, MLflow; the teacher scored by the default in-process HF scorer);
TRL's is benchmarks/gpu/trl_sdpo.py. Runs alternate A/B/A/B, TRL first in each pair. Each side's figure is
its steady iteration (the median of iterations 2 onward in a run, so our last iteration's full-state
save counts once, not as a mean), then the median over pairs; peak RSS is the
whole process tree's (the CLI's Prefect server and stage processes included), sampled every 0.2 s,
as RSS and as PSS (shared pages split between the processes that map them). Our side's harness
(benchmarks/gpu/pipeline_run.py: it writes the model, starts `sdpo run` and reads the run back
after it ends) is the tree's root and is not counted; TRL's trainer is its harness's own process.
Where the time goes: TRL's generation and no-gradient forwards (its teacher) against our rollout,
teacher and train stages' compute; the share of our iteration outside the three stages (each
stage's seconds run through writing its outputs: shards, checkpoints) and outside their compute;
where the memory goes: our tree's processes at its peak.
TRL's trainer is imported from the bench venv, never from the project's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
PROJECT_PYTHON = REPO / ".venv" / "bin" / "python"
# name -> (prompts per iteration, answers per prompt, max new tokens, micro-batch of TRL's step, the
# tokens of our packed micro-batch). A pack holds about the tokens of TRL's padded micro-batch where
# that is larger than 4096: 32 answers x (14 prompt + 256) = 8,640 at the long size. At the large
# size TRL's micro-batch holds 32 x (14 + 64) = 2,496 and at the small one 8 x 22 = 176.
SIZES = {"small": (8, 8, 8, 8, 4096), "large": (64, 8, 64, 32, 4096), "long": (64, 8, 256, 32, 8192)}
CPU = [
    "model.dtype=float32",
    "rollout.device=cpu",
    "rollout.dtype=float32",
    "rollout.top_k=16",
    # the default teacher scorer (the HF model in process): on the CPU it scores this work in ~0.8 of the
    # Megatron forward's time (`benchmarks/cpu_stages.py teacher` against `score_teacher`), which the
    # GPU config selects for tensor parallelism
    "teacher.backend=embedded",
    "train.fused_kernels=false",
    "train.loss_compile=false",
    "train.loss_chunk_tokens=0",
]


def _role(process: psutil.Process) -> str:
    """What a process of our tree is, by its command line."""
    line = " ".join(process.cmdline())
    for marker, role in (("flows.cli", "sdpo run"), ("uvicorn", "Prefect server"), ("-m tasks.", "stage/sandbox")):
        if marker in line:
            return role
    return "other"


def run_measured(
    command: list[str], *, env: dict[str, str], log: Path, count_root: bool = True
) -> tuple[list[dict[str, Any]], float, float, float, dict[str, float]]:
    """Run `command`; (its RESULT records, wall seconds, peak RSS and peak PSS of its process tree
    in GiB, and the tree's PSS by process role at that peak). RSS counts a page shared by several
    processes of the tree (a forked writer's copy of its parent, shared libraries) once per
    process; PSS splits it between them, so the tree's PSS is the memory it really holds. Without
    `count_root` the command is a harness around the measured processes and only its descendants
    count."""
    peak = peak_pss = 0.0
    roles: dict[str, float] = {}
    with log.open("w") as out:
        started = time.perf_counter()
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        root = psutil.Process(process.pid)
        done = threading.Event()

        def sample() -> None:
            nonlocal peak, peak_pss, roles
            while not done.is_set():
                try:
                    measured = ([root] if count_root else []) + root.children(recursive=True)
                    tree = [p for p in measured if p.is_running()]
                    memory = [p.memory_full_info() for p in tree]
                    peak = max(peak, sum(m.rss for m in memory) / 2**30)
                    pss = sum(m.pss for m in memory) / 2**30
                    if pss > peak_pss:
                        peak_pss, roles = pss, {}
                        for process, m in zip(tree, memory, strict=True):
                            role = _role(process)
                            roles[role] = round(roles.get(role, 0.0) + m.pss / 2**30, 3)
                except psutil.Error:
                    pass  # a process of the tree ended between the listing and the reading
                done.wait(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        code = process.wait()
        done.set()
        sampler.join()
        wall = time.perf_counter() - started
    if code != 0:
        raise SystemExit(f"{' '.join(command[:4])} ... exited with {code}; its output is in {log}")
    records = [json.loads(line[7:]) for line in log.read_text().splitlines() if line.startswith("RESULT ")]
    return records, wall, peak, peak_pss, roles


def one_pair(size: str, pair: int, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    prompts, group, tokens, micro, pack = SIZES[size]
    out = args.out / f"{size}-{pair}"
    shutil.rmtree(out, ignore_errors=True)  # a run left by an earlier invocation would only be read back
    trl, trl_wall, trl_rss, trl_pss, _ = run_measured(
        [sys.executable, "-m", "benchmarks.gpu.trl_sdpo", "--shape", args.shape, "--vocab", str(args.vocab)]
        + ["--out", str(out / "trl"), "--iterations", str(args.iterations), "--prompts", str(prompts)]
        + ["--group", str(group), "--new-tokens", str(tokens), "--top-k", "16", "--micro-batch", str(micro)],
        env=env,
        log=out.with_suffix(".trl.log"),
    )
    ours, ours_wall, ours_rss, ours_pss, ours_roles = run_measured(
        [str(PROJECT_PYTHON), "-m", "benchmarks.gpu.pipeline_run", "--shape", args.shape, "--vocab", str(args.vocab)]
        + ["--out", str(out / "ours"), "--iterations", str(args.iterations), *CPU]
        + [f"data.prompts_per_iteration={prompts}", f"rollout.group_size={group}"]
        + [f"rollout.max_new_tokens={tokens}", f"rollout.batch_size={prompts * group}", f"train.pack_tokens={pack}"],
        env=env,
        log=out.with_suffix(".ours.log"),
        count_root=False,
    )
    (trl_run,) = [r for r in trl if r["bench"] == "trl"]
    steady = [r for r in ours if r["bench"] == "pipeline_iteration" and r["iteration"] > 1]
    trl_iterations = [r for r in trl if r["bench"] == "trl_iteration" and r["iteration"] > 1]
    trl_steady = [r["wall_s"] for r in trl_iterations]

    def median(key: str) -> float:
        return round(statistics.median(r[key] for r in steady), 4)

    def trl_median(key: str) -> float:
        return round(statistics.median(r[key] for r in trl_iterations), 3)

    return {
        "size": size,
        "pair": pair,
        "trl_s": round(statistics.median(trl_steady), 3),
        "trl_mean_s": trl_run["steady_mean_s"],
        "ours_s": median("wall_s"),
        "ours_compute_s": round(
            statistics.median(r["rollout_compute_s"] + r["teacher_compute_s"] + r["train_compute_s"] for r in steady), 3
        ),
        "ours_rollout_s": median("rollout_compute_s"),
        "ours_teacher_s": median("teacher_compute_s"),
        "ours_train_s": median("train_compute_s"),
        "trl_generate_s": trl_median("generate_s"),
        "trl_teacher_s": trl_median("teacher_forward_s"),
        "trl_student_forward_s": trl_median("student_forward_s"),
        "ours_write_s": round(statistics.median(r["rollout_write_s"] + r["teacher_write_s"] for r in steady), 3),
        "outside_stages_share": median("outside_stages_share"),
        "outside_compute_share": median("outside_compute_share"),
        "trl_process_s": round(trl_wall, 1),
        "ours_process_s": round(ours_wall, 1),
        "trl_peak_rss_gib": round(trl_rss, 2),
        "ours_peak_rss_gib": round(ours_rss, 2),
        "trl_peak_pss_gib": round(trl_pss, 2),
        "ours_peak_pss_gib": round(ours_pss, 2),
        "ours_pss_by_process_gib": ours_roles,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["small", "large"])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=4, help="per run; iteration 1 is warm-up")
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=Path(".sdpo/bench-trl"))
    args = parser.parse_args()
    import trl  # noqa: F401  (fails here, before any run, outside the bench venv)

    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    threads = {k: "2" for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env = {
        **os.environ,
        **threads,
        "PYTHONPATH": str(REPO),
        "TRL_EXPERIMENTAL_SILENCE": "1",
        "PYTHONWARNINGS": "ignore",
    }
    rows = []
    for size in args.sizes:
        for pair in range(args.pairs):
            row = one_pair(size, pair, args, env)
            rows.append(row)
            print("RESULT " + json.dumps({"bench": "peer_trl_pair", **row}), flush=True)
    print(
        "\n| work | TRL s/step | ours s/iteration | ours / TRL | ours compute s | outside stages | outside compute "
        "| peak RSS ours / TRL GiB | peak PSS ours / TRL GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    medians = {}
    for size in args.sizes:
        mine = [r for r in rows if r["size"] == size]
        medians[size] = med = {
            k: statistics.median(r[k] for r in mine)
            for k in mine[0]
            if k not in ("size", "pair", "ours_pss_by_process_gib")
        }
        prompts, group, tokens, *_ = SIZES[size]
        print(
            f"| {prompts} × {group}, ≤ {tokens} new tokens | {med['trl_s']:.2f} | {med['ours_s']:.2f} | "
            f"**{med['ours_s'] / med['trl_s']:.2f}** | {med['ours_compute_s']:.2f} | {med['outside_stages_share']:.1%} | "
            f"{med['outside_compute_share']:.1%} | "
            f"{med['ours_peak_rss_gib']:.2f} / {med['trl_peak_rss_gib']:.2f} | "
            f"{med['ours_peak_pss_gib']:.2f} / {med['trl_peak_pss_gib']:.2f} |"
        )
    print(
        "\n| work | sampling TRL / ours s | teacher forward TRL / ours s | the rest of TRL's step / our "
        "training s | ours outside compute s | of which shard writes s |"
    )
    print("|---|---|---|---|---|---|")
    for size, med in medians.items():
        prompts, group, tokens, *_ = SIZES[size]
        trl_rest = med["trl_s"] - med["trl_generate_s"] - med["trl_teacher_s"]
        print(
            f"| {prompts} × {group}, ≤ {tokens} new tokens | {med['trl_generate_s']:.2f} / {med['ours_rollout_s']:.2f} | "
            f"{med['trl_teacher_s']:.2f} / {med['ours_teacher_s']:.2f} | {trl_rest:.2f} / {med['ours_train_s']:.2f} | "
            f"{med['ours_s'] - med['ours_compute_s']:.2f} | {med['ours_write_s']:.2f} |"
        )
    print("\nour process tree's PSS at its peak, by process (GiB):")
    for row in rows:
        parts = ", ".join(f"{role} {gib:.2f}" for role, gib in sorted(row["ours_pss_by_process_gib"].items()))
        print(f"  {row['size']} pair {row['pair'] + 1}: {parts}")


if __name__ == "__main__":
    main()
