"""discovery@k of several test-time runs on one plot and in one table (docs/results.md).

    .venv/bin/python benchmarks/discovery_compare.py --root runs/test-time \\
        test-time-arith test-time-arith-demos-only test-time-arith-grpo --plot discovery.png

Each run is a finished `sdpo test-time` run; its `discovery` stage is read from the store. The
best-of-k curve is the first run's (every run of one config screens the same base model).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tasks.runtime import open_run  # noqa: E402
from tasks.test_time import read_discovery  # noqa: E402
from tasks.tracking.compare import save_figure  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="test-time run names")
    parser.add_argument("--root", required=True, help="run root of the test-time runs")
    parser.add_argument("--plot", type=Path, default=Path("discovery.png"))
    args = parser.parse_args()
    records = {name: read_discovery(open_run(args.root, name)) for name in args.runs}
    first = records[args.runs[0]]
    for name, record in records.items():
        if record["k"] != first["k"]:
            raise SystemExit(f"{name} reports k = {record['k']}, {args.runs[0]} k = {first['k']}: not comparable")
    print("| k | " + " | ".join(args.runs) + " | best-of-k (base model) |")
    print("|---" * (len(args.runs) + 2) + "|")
    for i, k in enumerate(first["k"]):
        cells = [f"{records[name]['test_time'][i]:.3f}" for name in args.runs]
        print(f"| {k} | " + " | ".join(cells) + f" | {first['best_of_k'][i]:.3f} |")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, record in records.items():
        ax.plot(record["k"], record["test_time"], marker="o", label=name)
    ax.plot(first["k"], first["best_of_k"], marker="s", linestyle="--", label="best-of-k (base model)")
    ax.set_xlabel("attempts k")
    ax.set_ylabel("discovery@k")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    print(f"plot: {save_figure(fig, args.plot)}")


if __name__ == "__main__":
    main()
