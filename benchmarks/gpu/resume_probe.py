"""Exact resume on one GPU: the same run straight, advanced one iteration per process, and advanced
one iteration per process with the full state every 2 iterations (so every other iteration's
trainer is rebuilt by a checked replay), compared stage by stage.

    python -m benchmarks.gpu.resume_probe --out /tmp/probe [--shape 135m --vocab 49152 --iterations 4] [KEY=VALUE ...]

Each arm runs `benchmarks/gpu/pipeline.yaml` (bf16, the embedded engine on the GPU, the Megatron
teacher) on one random-init Qwen3 of `--shape` written once (benchmarks/gpu/pipeline_run.py). For
every iteration the probe prints digests of what each stage committed: the sampled response ids
and the student's top-K ids (rollout), the teacher's top-K log-probs (teacher) and the policy
weights file (train), so
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
from pathlib import Path
from typing import Any

from benchmarks.gpu.pipeline_run import CONFIG, write_policy

GPU = [
    "model.dtype=bfloat16",
    "rollout.dtype=bfloat16",
    "rollout.device=cuda",
    "teacher.backend=megatron",
    "train.attention=sdpa",
    "data.prompts_per_iteration=16",
    "rollout.group_size=8",
    "rollout.max_new_tokens=256",
    "rollout.top_k=16",
    "rollout.batch_size=128",
    "train.steps_per_iteration=4",
    "train.micro_batch_size=16",
    "train.packing=false",
    "tracking.log_model=false",
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
    from storage.manifest import iteration_committed
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
            }
        )
    return rows


def run_arm(arm: str, policy: Path, args: argparse.Namespace) -> dict[str, Any]:
    command, every = ARMS[arm]
    out = args.out / arm
    overrides = [
        "name=probe",
        f"iterations={args.iterations}",
        f"model.path={policy}",
        f"storage.root={out / 'runs'}",
        f"storage.cache_dir={out / 'cache'}",
        f"tracking.uri=sqlite:///{out / 'mlflow.db'}",
        f"train.megatron_checkpoint_every={every}",
        *GPU,
        *args.overrides,
    ]
    env = {**os.environ, "PREFECT_HOME": str(out / "prefect")}
    calls = 1 if command == "run" else min(args.iterations, args.max_calls or args.iterations)
    error = None
    for _ in range(calls):
        done = subprocess.run(
            [sys.executable, "-m", "flows.cli", command, str(CONFIG), *overrides],
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
    return {"arm": arm, "error": error, "iterations": stage_digests(out / "runs", "probe", args.iterations)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", default="135m")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=list(ARMS))
    parser.add_argument("--max-calls", type=int, default=None, help="advance arms: stop after this many processes")
    parser.add_argument("overrides", nargs="*", help="more dotted overrides for every arm")
    args = parser.parse_args()
    args.out = args.out.resolve()
    policy = write_policy(args.shape, args.out / "policy", vocab=args.vocab)
    results = []
    for arm in args.arms:
        result = run_arm(arm, policy, args)
        results.append(result)
        print("RESULT " + json.dumps(result), flush=True)
    print("\n| iteration | stage | " + " | ".join(r["arm"] for r in results) + " | same |")
    print("|---|---|" + "---|" * (len(results) + 1))
    for n in range(args.iterations):
        for stage in ("rollout", "teacher", "policy"):
            cells = [r["iterations"][n][stage] if n < len(r["iterations"]) else "-" for r in results]
            print(f"| {n + 1} | {stage} | " + " | ".join(cells) + f" | {'yes' if len(set(cells)) == 1 else 'NO'} |")


if __name__ == "__main__":
    main()
