"""What the code verifier said about each iteration's answers, per run of a study.

    .venv/bin/python benchmarks/feedback_kinds.py --root runs/code-study [--every 5] [RUN ...]

Reads every run's rollout shards under ROOT (the runs of `benchmarks/study.py`, or the ones named)
and sorts each answer by the verifier's verdict: passed; truncated; no fenced code block; the
tested function not defined (a NameError on a name the failing test calls: the answer named its
function otherwise); another runtime error; time limit; wrong answer. Prints one Markdown table
per run with the share of each kind per iteration (every `--every`-th iteration and the last),
which shows movement that a reward of 0 everywhere hides.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

KINDS = (
    "passed",
    "truncated",
    "no code block",
    "tested function undefined",
    "runtime error",
    "time limit",
    "wrong answer",
)
_UNDEFINED = re.compile(r"NameError: name '([^']+)' is not defined")


def kind(reward: float, feedback: str | None, format_error: bool, finish_reason: str) -> str:
    """The verdict's kind (KINDS) from a rollout row's columns."""
    if reward >= 1.0:
        return "passed"
    if finish_reason == "length":
        return "truncated"
    if format_error:
        return "no code block"
    text = feedback or ""
    if text.startswith("Runtime Error"):
        undefined = _UNDEFINED.search(text)
        executed = text.split("Last Executed Input", 1)[-1]
        if undefined and re.search(rf"\b{re.escape(undefined.group(1))}\s*\(", executed):
            return "tested function undefined"
        return "runtime error"
    if text.startswith("Time Limit"):
        return "time limit"
    return "wrong answer"


def run_table(run: Path, every: int) -> str:
    import pyarrow.parquet as pq

    shards = sorted(run.glob("iter-*/rollout/*.parquet"), key=lambda p: (int(p.parent.parent.name[5:]), p.name))
    if not shards:
        raise SystemExit(f"{run}: no rollout shards (iter-*/rollout/*.parquet)")
    per_iteration: dict[int, Counter] = {}
    for shard in shards:
        table = pq.read_table(shard, columns=["reward", "feedback", "format_error", "finish_reason"]).to_pylist()
        counts = per_iteration.setdefault(int(shard.parent.parent.name[5:]), Counter())
        counts.update(kind(r["reward"], r["feedback"], r["format_error"], r["finish_reason"]) for r in table)
    iterations = sorted(per_iteration)
    shown = [i for i in iterations if (i - iterations[0]) % every == 0 or i == iterations[-1]]
    lines = [f"### {run.name}", "", "| iteration | " + " | ".join(KINDS) + " |", "|---" * (len(KINDS) + 1) + "|"]
    for i in shown:
        total = sum(per_iteration[i].values())
        lines.append(f"| {i} | " + " | ".join(f"{per_iteration[i][k] / total:.3f}" for k in KINDS) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("runs", nargs="*", help="run names under ROOT (default: every run with rollout shards)")
    args = parser.parse_args()
    if args.every < 1:
        raise SystemExit(f"--every must be >= 1, got {args.every}")
    runs = [args.root / name for name in args.runs] or sorted(
        p for p in args.root.iterdir() if p.is_dir() and any(p.glob("iter-*/rollout"))
    )
    if not runs:
        raise SystemExit(f"{args.root}: no runs with rollout shards")
    print("\n\n".join(run_table(run, args.every) for run in runs))


if __name__ == "__main__":
    main()
