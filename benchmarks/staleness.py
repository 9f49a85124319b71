"""Iteration throughput with `pipeline.max_staleness` k against k = 0, and the learning curves.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/staleness.py configs/demo.yaml --root runs/async \\
        --staleness 0 1 [--iterations 60] [KEY=VALUE ...]

Runs `sdpo run CONFIG name=<config name>-k<k> pipeline.max_staleness=<k> storage.root=ROOT` as a
process for each k, one after the other (a run already complete is only read back), then reads
each run's iterations back from the store: the wall time between consecutive iteration commits
(the manifests' `created_at`; evaluations fall between some of them, so the median over the
iterations without one is reported as the steady time per iteration), the time from the first
commit to the last, and the greedy accuracy at each evaluation. Prints one Markdown table and
the side-by-side ratio.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tasks.tracking.compare import GREEDY, read_history  # noqa: E402


def commit_times(root: str, name: str) -> dict[int, float]:
    """Iteration -> when its manifest was committed (seconds)."""
    from storage.layout import RunLayout
    from storage.manifest import read_iteration_manifest, read_latest

    layout = RunLayout(root, name)
    return {
        n: datetime.fromisoformat(read_iteration_manifest(layout, n).data["created_at"]).timestamp()
        for n in range(1, (read_latest(layout) or 0) + 1)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path)
    parser.add_argument("--root", required=True)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--iterations", type=int, default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    import yaml

    base = yaml.safe_load(args.config.read_text())["name"]
    extra = [*args.overrides, *([f"iterations={args.iterations}"] if args.iterations else [])]
    rows = []
    for k in args.staleness:
        name = f"{base}-k{k}"
        command = [sys.executable, "-m", "flows.cli", "run", str(args.config), f"name={name}"]
        command += [f"pipeline.max_staleness={k}", f"storage.root={args.root}", *extra]
        print("$", " ".join(command[2:]), flush=True)
        subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        history = read_history(args.root, name)
        times = commit_times(args.root, name)
        evaluated = set(history.evals)
        gaps = [times[n] - times[n - 1] for n in sorted(times) if n - 1 in times and n - 1 not in evaluated]
        curve = ", ".join(f"{n}: {m[GREEDY]:.3f}" for n, m in sorted(history.evals.items()) if GREEDY in m)
        rows.append((k, statistics.median(gaps), times[max(times)] - times[min(times)], len(times), curve))
    print(
        "\n| max_staleness | median s / iteration (steady) | first to last commit, s | iterations | greedy accuracy |"
    )
    print("|---|---|---|---|---|")
    for k, median, span, count, curve in rows:
        print(f"| {k} | {median:.2f} | {span:.1f} | {count} | {curve} |")
    reference = rows[0][1]
    for k, median, *_ in rows[1:]:
        print(f"throughput, k = {k} against k = {rows[0][0]}: {reference / median:.2f}x")


if __name__ == "__main__":
    main()
