"""Exact resume on one GPU: the same run straight, advanced one iteration per process, and advanced
one iteration per process with the full state every 2 iterations (so every other iteration's
trainer is rebuilt by a checked replay), compared stage by stage.

    python -m benchmarks.gpu.resume_probe --out /tmp/probe [--shape 135m --vocab 49152 --iterations 4] [KEY=VALUE ...]
    python -m benchmarks.gpu.resume_probe --out /tmp/probe --config configs/tools_bfcl.yaml \
        --arms straight straight straight advance-replay advance-replay advance-replay --jobs 6

By default each arm runs `benchmarks/gpu/pipeline.yaml` (bf16, the embedded engine on the GPU, the
Megatron teacher) on one random-init Qwen3 of `--shape` written once (benchmarks/gpu/pipeline_run.py);
with `--config` it runs that config as is (its model, data and sizes) with the GPU placement only.
An arm named more than once runs as that many copies (`straight-1`, `straight-2`, ...), and `--jobs`
runs that many arms at the same time on the one GPU, as a study's runs share it: copies of one arm
that part then show that processes sharing the GPU change what a run computes. For every iteration
the probe prints digests of what each stage committed: the sampled response ids and the student's
top-K ids (rollout), the teacher's top-K log-probs (teacher) and the policy weights file (train), so
the first stage at which two arms part names where determinism ends. An arm whose replay check
fails (`tasks.megatron.resume.check_replay`) ends with its error in the RESULT line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.gpu.pipeline_run import CONFIG, write_policy

PLACEMENT = [  # every arm: the GPU, as the studies place it
    "model.dtype=bfloat16",
    "rollout.dtype=bfloat16",
    "rollout.device=cuda",
    "teacher.backend=megatron",
    "train.attention=sdpa",
    "tracking.log_model=false",
    "eval.enabled=false",
    "eval.every=0",
]
SIZES = [  # the default config only: a study-sized iteration on the random-init model
    "data.prompts_per_iteration=16",
    "rollout.group_size=8",
    "rollout.max_new_tokens=256",
    "rollout.top_k=16",
    "rollout.batch_size=128",
    "train.steps_per_iteration=4",
    "train.micro_batch_size=16",
    "train.packing=false",
]
ARMS = {  # name -> (command, full state every k)
    "straight": ("run", 1),
    "advance": ("advance", 1),
    "advance-replay": ("advance", 2),
}


def _digest(rows: Any) -> str:
    """sha256 of a column's rows (arrays or id lists), by their values' bytes."""
    import numpy as np

    h = hashlib.sha256()
    for row in rows:
        array = np.asarray(row)
        h.update(str((array.dtype, array.shape)).encode())
        h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()[:12]


def stage_digests(root: Path, name: str, iterations: int) -> list[dict[str, Any]]:
    from storage.checkpoints import resolve_checkpoint
    from storage.layout import RunLayout
    from storage.manifest import iteration_committed, read_iteration_manifest
    from storage.shard_reader import read_stage_columns

    layout = RunLayout(str(root), name)
    rows = []
    for n in range(1, iterations + 1):
        if not iteration_committed(layout, n):
            break
        rollout = read_stage_columns(layout, n, "rollout", verify=False)
        teacher = read_stage_columns(layout, n, "teacher", verify=False)
        policy = {f["name"]: f["sha256"] for f in resolve_checkpoint(layout, n, "policy").data["files"]}
        rows.append(
            {
                "iteration": n,
                "rollout": _digest([*rollout["response_ids"], *rollout["topk_ids"]]),
                "teacher": _digest(teacher["teacher_topk_logprobs"]),
                "policy": policy["model.safetensors"][:12],
                "train_s": round(read_iteration_manifest(layout, n).data["metrics"]["train/seconds"], 2),
            }
        )
    return rows


def arm_names(arms: list[str]) -> list[tuple[str, str]]:
    """(label, arm) for each requested arm; an arm asked for more than once is numbered."""
    return [(f"{arm}-{arms[: i + 1].count(arm)}" if arms.count(arm) > 1 else arm, arm) for i, arm in enumerate(arms)]


def run_arm(label: str, arm: str, policy: Path | None, args: argparse.Namespace) -> dict[str, Any]:
    command, every = ARMS[arm]
    out = args.out / label
    model = [f"model.path={policy}", *SIZES] if policy is not None else []
    overrides = [
        "name=probe",
        f"iterations={args.iterations}",
        *model,
        f"storage.root={out / 'runs'}",
        f"storage.cache_dir={out / 'cache'}",
        f"tracking.uri=sqlite:///{out / 'mlflow.db'}",
        f"train.megatron_checkpoint_every={every}",
        *PLACEMENT,
        *args.overrides,
    ]
    env = {**os.environ, "PREFECT_HOME": str(out / "prefect")}
    calls = 1 if command == "run" else min(args.iterations, args.max_calls or args.iterations)
    error = None
    for _ in range(calls):
        done = subprocess.run(
            [sys.executable, "-m", "flows.cli", command, str(args.config or CONFIG), *overrides],
            env=env,
            capture_output=True,
            text=True,
        )
        (out / "log.txt").parent.mkdir(parents=True, exist_ok=True)
        with (out / "log.txt").open("a") as log:
            log.write(done.stdout + done.stderr)
        if done.returncode != 0:
            lines = [line for line in (done.stdout + done.stderr).splitlines() if "Error" in line]
            error = (lines[-1] if lines else f"exit {done.returncode}")[:400]
            break
    return {"arm": label, "error": error, "iterations": stage_digests(out / "runs", "probe", args.iterations)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", default="135m")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--config", type=Path, default=None, help="run this config (its own model and sizes)")
    parser.add_argument(
        "--arms", nargs="+", choices=sorted(ARMS), default=list(ARMS), help="an arm named n times runs n copies"
    )
    parser.add_argument("--jobs", type=int, default=1, help="arms running at the same time on the GPU")
    parser.add_argument("--max-calls", type=int, default=None, help="advance arms: stop after this many processes")
    parser.add_argument("overrides", nargs="*", help="more dotted overrides for every arm")
    args = parser.parse_args()
    args.out = args.out.resolve()
    policy = None if args.config else write_policy(args.shape, args.out / "policy", vocab=args.vocab)
    arms = arm_names(args.arms)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # each arm is a process of its own
        futures = [pool.submit(run_arm, label, arm, policy, args) for label, arm in arms]
        results = []
        for future in futures:
            results.append(future.result())
            print("RESULT " + json.dumps(results[-1]), flush=True)
    print("\n| iteration | stage | " + " | ".join(r["arm"] for r in results) + " | same |")
    print("|---|---|" + "---|" * (len(results) + 1))
    for n in range(args.iterations):
        for stage in ("rollout", "teacher", "policy"):
            cells = [r["iterations"][n][stage] if n < len(r["iterations"]) else "-" for r in results]
            print(f"| {n + 1} | {stage} | " + " | ".join(cells) + f" | {'yes' if len(set(cells)) == 1 else 'NO'} |")


if __name__ == "__main__":
    main()
