"""What each stage launcher costs per iteration on the demo config (one machine, 2 cores).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/launchers.py [--iterations 5]

For each launcher — every stage in the flow's process (`inprocess`), every stage in a fresh
`sdpo stage` process (`subprocess`), the train stage under a one-rank `torchrun` (`torchrun`) —
the demo config runs `--iterations` iterations into a fresh root (the bootstrapped base model is
cached once before), and the per-iteration wall time is read from the iteration manifests'
commit times (iteration n's commit minus iteration n-1's, n >= 2). Printed: the median per
launcher, the overhead against `inprocess`, and the compute inside the stages (the stages' own
`*/stage_seconds`), so the difference is process start, imports and model loads.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAUNCHERS = {
    "inprocess": [],
    "subprocess": [f"launch.{s}.launcher=subprocess" for s in ("rollout", "teacher", "train", "eval")],
    "torchrun": ["launch.train.launcher=torchrun", "launch.train.nproc_per_node=1"],
}


def run(root: Path, name: str, iterations: int, extra: list[str], cache: Path) -> float:
    args = [
        sys.executable,
        "-m",
        "flows.cli",
        "run",
        str(REPO / "configs" / "demo.yaml"),
        f"name={name}",
        f"iterations={iterations}",
        f"storage.root={root}",
        f"storage.cache_dir={cache}",
        "eval.every=0",
        f"tracking.uri=sqlite:///{root / 'mlflow.db'}",
        *extra,
    ]
    started = time.perf_counter()
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return time.perf_counter() - started


def per_iteration(root: Path, name: str, iterations: int) -> tuple[list[float], list[float]]:
    """(wall seconds of iterations 2..N, their summed stage seconds) from the iteration manifests."""
    stamps, inside = [], []
    for n in range(1, iterations + 1):
        manifest = json.loads((root / name / f"iter-{n}" / "_manifest.json").read_text())
        stamps.append(dt.datetime.fromisoformat(manifest["created_at"]))
        inside.append(sum(manifest["metrics"].get(f"{s}/stage_seconds", 0.0) for s in ("rollout", "teacher", "train")))
    walls = [(b - a).total_seconds() for a, b in zip(stamps, stamps[1:], strict=False)]
    return walls, inside[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sdpo-launchers-") as tmp:
        base, cache = Path(tmp), Path(tmp) / "cache"
        run(base / "warm", "warm", 1, [], cache)  # bootstrap the base model into the shared cache
        rows = {}
        for launcher, extra in LAUNCHERS.items():
            root = base / launcher
            total = run(root, launcher, args.iterations, extra, cache)
            walls, inside = per_iteration(root, launcher, args.iterations)
            rows[launcher] = (statistics.median(walls), statistics.median(inside), total)
        ref = rows["inprocess"][0]
        print(
            f"{'launcher':<11} {'s/iteration':>12} {'stage compute':>14} {'overhead vs inprocess':>22} {'whole run s':>12}"
        )
        for launcher, (wall, inside, total) in rows.items():
            print(f"{launcher:<11} {wall:>12.2f} {inside:>14.2f} {wall - ref:>+21.2f}s {total:>12.1f}")
        print(f"(median of iterations 2..{args.iterations}; demo config, eval.every=0, {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
