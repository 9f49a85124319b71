"""Accuracy and wall-clock against `pipeline.max_staleness` k: the table a user picks k from.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/staleness.py configs/study_arith.yaml --root runs/staleness \\
        --staleness 0 1 2 3 --seeds 0 1 2 --target 0.3 [--iterations 20] [KEY=VALUE ...]

Runs `sdpo run CONFIG name=<config name>-k<k>-s<seed> seed=<seed> pipeline.max_staleness=<k>
storage.root=ROOT` as a process for each k and seed, one after the other (a run already complete is
only read back), then reads each run back from the store: the wall time between consecutive
iteration commits (the manifests' `created_at`; evaluations fall between some of them, so the
median over the iterations without one is the steady time per iteration), the wall time from the
base model's evaluation to the first evaluation at or above `--target` greedy accuracy, the greedy
accuracy at each evaluation, and the importance weights (their mean and the share clipped) over the
iterations. Prints one Markdown table, per k over the seeds: the final greedy accuracy (mean ±
standard deviation), the steady seconds per iteration and the seconds to the target (medians;
"not reached" when a seed never reached it), the weights, and the throughput against k = the first.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tasks.tracking.compare import GREEDY, read_history  # noqa: E402

IS_MEAN, IS_CLIPPED = "sdpo/is_weight_mean", "sdpo/is_clip_fraction"


def commit_times(root: str, name: str) -> dict[int, float]:
    """Iteration -> when its manifest was committed (seconds); 0 -> when the base model's evaluation was."""
    from storage.layout import RunLayout
    from storage.manifest import read_iteration_manifest, read_latest, read_stage_manifest, stage_done

    layout = RunLayout(root, name)
    times = {
        n: datetime.fromisoformat(read_iteration_manifest(layout, n).data["created_at"]).timestamp()
        for n in range(1, (read_latest(layout) or 0) + 1)
    }
    if stage_done(layout, 0, "eval"):
        times[0] = datetime.fromisoformat(read_stage_manifest(layout, 0, "eval").data["created_at"]).timestamp()
    return times


@dataclass(frozen=True)
class Run:
    """One run's figures."""

    steady_s: float  # median seconds between commits of iterations that evaluate nothing
    to_target_s: float | None  # seconds from the base model's evaluation to the first at the target
    final: float  # greedy accuracy at the last evaluation
    curve: str
    is_mean: float | None
    is_clipped: float | None


def measure(root: str, name: str, target: float) -> Run:
    history = read_history(root, name)
    times = commit_times(root, name)
    evaluated = set(history.evals)
    gaps = [times[n] - times[n - 1] for n in sorted(times) if n > 1 and n - 1 in times and n - 1 not in evaluated]
    graded = {n: m[GREEDY] for n, m in sorted(history.evals.items()) if GREEDY in m}
    reached = [n for n, value in graded.items() if value >= target and n in times]
    to_target = times[reached[0]] - times[0] if reached and 0 in times else None

    def mean_of(key: str) -> float | None:
        values = [m[key] for m in history.iterations.values() if key in m]
        return statistics.mean(values) if values else None

    return Run(
        steady_s=statistics.median(gaps),
        to_target_s=to_target,
        final=graded[max(graded)],
        curve=", ".join(f"{n}: {value:.3f}" for n, value in graded.items()),
        is_mean=mean_of(IS_MEAN),
        is_clipped=mean_of(IS_CLIPPED),
    )


def spread(values: list[float]) -> str:
    return f"{values[0]:.3f}" if len(values) == 1 else f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path)
    parser.add_argument("--root", required=True)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--target", type=float, required=True, help="greedy accuracy the wall-clock is measured to")
    parser.add_argument("--iterations", type=int, default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()  # KEY=VALUE overrides after the options too
    import yaml

    base = yaml.safe_load(args.config.read_text())["name"]
    extra = [*args.overrides, *([f"iterations={args.iterations}"] if args.iterations else [])]
    runs: dict[int, list[Run]] = {}
    for k in args.staleness:
        for seed in args.seeds:
            name = f"{base}-k{k}-s{seed}"
            command = [sys.executable, "-m", "flows.cli", "run", str(args.config), f"name={name}", f"seed={seed}"]
            command += [f"pipeline.max_staleness={k}", f"storage.root={args.root}", *extra]
            print("$", " ".join(command[2:]), flush=True)
            subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
            runs.setdefault(k, []).append(measure(args.root, name, args.target))
    print(
        f"\n| max_staleness | seeds | greedy final | s / iteration (median, steady) | s to greedy {args.target} "
        "(median) | importance weight mean | share clipped | throughput | per seed: greedy at each evaluation |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    first = statistics.median(r.steady_s for r in runs[args.staleness[0]])
    for k, measured in runs.items():
        steady = statistics.median(r.steady_s for r in measured)
        reached = [r.to_target_s for r in measured if r.to_target_s is not None]
        to_target = (
            f"{statistics.median(reached):.0f}" if len(reached) == len(measured) else "not reached by every seed"
        )
        weights = [r.is_mean for r in measured if r.is_mean is not None]
        clipped = [r.is_clipped for r in measured if r.is_clipped is not None]
        print(
            f"| {k} | {len(measured)} | {spread([r.final for r in measured])} | {steady:.2f} | {to_target} "
            f"| {spread(weights) if weights else '-'} | {spread(clipped) if clipped else '-'} | {first / steady:.2f}x "
            f"| {'; '.join(r.curve for r in measured)} |"
        )


if __name__ == "__main__":
    main()
