"""What the verifier said about each iteration's answers, per run of a study.

    .venv/bin/python benchmarks/feedback_kinds.py --root runs/code-study [--every 5] [RUN ...]

Reads every run's finished rollout stages under ROOT (the runs of `benchmarks/study.py`, or the ones
named), through their stage manifests, and sorts each answer by the verifier's verdict. For the code
verifier: passed; truncated; no fenced code block; the tested function not defined (a NameError on a
name the failing test calls: the answer named its function otherwise); another runtime error; time
limit; wrong answer. For the function-call verifier: passed; truncated; no call in the expected
format; the wrong number of calls; a wrong or unknown function; arguments (missing, unexpected, of
the wrong type or value) of the right function. Prints one Markdown table per run with the share of
each kind per iteration (every `--every`-th iteration and the last), which shows movement that a
reward of 0 everywhere hides.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from storage.layout import RunLayout  # noqa: E402 -- after the repository is on the path

KINDS = {
    "code": (
        "passed",
        "truncated",
        "no code block",
        "tested function undefined",
        "runtime error",
        "time limit",
        "wrong answer",
    ),
    "function_call": ("passed", "truncated", "not a call", "call count", "wrong function", "arguments"),
}
_UNDEFINED = re.compile(r"NameError: name '([^']+)' is not defined")
_WRONG_FUNCTION = re.compile(r"is not (?:one of the available functions|the right function)|No function should be")


def kind(verifier: str, reward: float, feedback: str | None, format_error: bool, finish_reason: str) -> str:
    """The verdict's kind (KINDS[verifier]) from a rollout row's columns."""
    if reward >= 1.0:
        return "passed"
    if finish_reason == "length":
        return "truncated"
    if verifier == "function_call":
        return _call_kind(feedback or "", format_error)
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


def _call_kind(feedback: str, format_error: bool) -> str:
    if format_error:
        return "not a call"
    if "function call(s), got" in feedback:
        return "call count"
    return "wrong function" if _WRONG_FUNCTION.search(feedback) else "arguments"


def run_table(layout: RunLayout, every: int) -> str:
    from storage.layout import read_run_config
    from storage.manifest import stage_done
    from storage.shard_reader import read_stage_columns

    verifier = read_run_config(layout)["verifier"]["name"]
    if verifier not in KINDS:
        raise SystemExit(f"{layout.run_url}: verifier {verifier!r} has no verdict kinds here; known: {sorted(KINDS)}")
    kinds = KINDS[verifier]
    per_iteration: dict[int, Counter] = {}
    for n in layout.iterations():
        if not stage_done(layout, n, "rollout"):
            continue
        rows = read_stage_columns(layout, n, "rollout", columns=["reward", "feedback", "format_error", "finish_reason"])
        per_iteration[n] = Counter(
            kind(verifier, float(reward), feedback, bool(format_error), finish)
            for reward, feedback, format_error, finish in zip(
                rows["reward"], rows["feedback"], rows["format_error"], rows["finish_reason"], strict=True
            )
        )
    if not per_iteration:
        raise SystemExit(f"{layout.run_url}: no finished rollout stage")
    iterations = sorted(per_iteration)
    shown = [i for i in iterations if (i - iterations[0]) % every == 0 or i == iterations[-1]]
    header = "| iteration | " + " | ".join(kinds) + " |"
    lines = [f"### {layout.run_name}", "", header, "|---" * (len(kinds) + 1) + "|"]
    for i in shown:
        total = sum(per_iteration[i].values())
        lines.append(f"| {i} | " + " | ".join(f"{per_iteration[i][k] / total:.3f}" for k in kinds) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("runs", nargs="*", help="run names under ROOT (default: every run with rollout shards)")
    args = parser.parse_args()
    if args.every < 1:
        raise SystemExit(f"--every must be >= 1, got {args.every}")
    names = args.runs or sorted(p.name for p in args.root.iterdir() if (p / "run.json").is_file())
    if not names:
        raise SystemExit(f"{args.root}: no runs (folders with a run.json)")
    print("\n\n".join(run_table(RunLayout(str(args.root), name), args.every) for name in names))


if __name__ == "__main__":
    main()
