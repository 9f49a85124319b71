"""A seeded study: arms (override sets) x seeds of one config, run one after another, then summarised.

    .venv/bin/python benchmarks/study.py configs/study_arith.yaml --root runs/study \\
        --arm sdpo= --arm grpo=loss.type=grpo --seeds 0 1 2 [--plot study.png]

Each run is `sdpo run CONFIG name=<arm>-s<seed> seed=<seed> storage.root=ROOT <overrides>` as a
process, so a study that is interrupted resumes where it stopped (runs already finished are only
read back). Then, from the store (`tasks.tracking.compare`): per arm, the final greedy accuracy,
avg@n and pass@n as mean ± standard deviation over seeds, the rollout response length, the seconds,
and for every arm the median over seeds of the first evaluated iteration at which a seed reached
the reference arm's mean final greedy accuracy (`--reference`, default the last arm). Prints a
Markdown table and writes the plot of every run's curves.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tasks.tracking.compare import GREEDY, ROLLOUT_LENGTH, RunHistory, read_history, write_plot  # noqa: E402


def run_arm(config: Path, root: str, arm: str, overrides: list[str], seed: int) -> None:
    command = [sys.executable, "-m", "flows.cli", "run", str(config), f"name={arm}-s{seed}", f"seed={seed}"]
    command += [f"storage.root={root}", f"tracking.uri=sqlite:///{Path(root).resolve() / 'mlflow.db'}", *overrides]
    print("$", " ".join(command[2:]), flush=True)
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL)


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def first_reaching(history: RunHistory, target: float) -> int | None:
    reached = [n for n, m in sorted(history.evals.items()) if m.get(GREEDY, -1.0) >= target]
    return reached[0] if reached else None


def summarise(arms: dict[str, list[RunHistory]], reference: str) -> str:
    finals = {a: [h.evals[max(h.evals)] for h in hs] for a, hs in arms.items()}
    target = statistics.mean(f[GREEDY] for f in finals[reference])
    n = next(int(k.rsplit("_", 1)[1]) for k in finals[reference][0] if k.startswith("eval/avg_at_"))
    lines = [
        f"| arm | seeds | greedy base | greedy final | avg@{n} final | pass@{n} final | rollout length (last) "
        f"| first iteration at {reference}'s final {target:.3f} (median; per seed) | seconds per run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, histories in arms.items():
        reach = [first_reaching(h, target) for h in histories]
        hit = [r for r in reach if r is not None]
        median = f"{statistics.median(hit):g}" if len(hit) == len(reach) else "not reached by every seed"
        lines.append(
            f"| {arm} | {len(histories)} | {spread([h.evals[0][GREEDY] for h in histories])} "
            f"| {spread([f[GREEDY] for f in finals[arm]])} "
            f"| {spread([f[f'eval/avg_at_{n}'] for f in finals[arm]])} "
            f"| {spread([f[f'eval/pass_at_{n}'] for f in finals[arm]])} "
            f"| {spread([h.iterations[h.last()][ROLLOUT_LENGTH] for h in histories])} "
            f"| {median}; {', '.join('-' if r is None else str(r) for r in reach)} "
            f"| {statistics.median(h.seconds[h.last()] for h in histories):.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path)
    parser.add_argument("--root", required=True, help="run root of the study's runs")
    parser.add_argument("--arm", action="append", required=True, help="NAME=OVERRIDE,OVERRIDE,... (repeatable)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--reference", help="arm whose mean final accuracy the others must reach (default: last)")
    parser.add_argument("--plot", type=Path, default=Path("study.png"))
    args = parser.parse_args()
    arms: dict[str, list[str]] = {}
    for spec in args.arm:
        name, _, overrides = spec.partition("=")
        arms[name] = [o for o in overrides.split(",") if o]
    for seed in args.seeds:  # seed-major: an interrupted study has every arm at the same seeds
        for arm, overrides in arms.items():
            run_arm(args.config, args.root, arm, overrides, seed)
    histories = {arm: [read_history(args.root, f"{arm}-s{seed}") for seed in args.seeds] for arm in arms}
    print(summarise(histories, args.reference or list(arms)[-1]))
    print(f"plot: {write_plot([h for hs in histories.values() for h in hs], args.plot)}")


if __name__ == "__main__":
    main()
