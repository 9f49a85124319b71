"""What the retention pass after each commit costs as a run grows.

After every commit the flow applies the run's checkpoint retention (`tasks.runtime.retain_after_commit`,
`storage/retention.py`). This builds a run in a local (file://) store with a policy, an EMA teacher
and a full training state per iteration (one small file each: no pass reads the files), and at each
of `--iterations` run lengths times two passes and counts the store operations each makes (exists,
read, list: on S3 each is a request):
- the full pass, `apply` (`sdpo gc`), at that length;
- the pass after a commit, `apply_after_commit` (the flow's), after each of the last `--repeats`
  commits up to that length.
Two rule sets: the default (keep everything) and `last: 2` for both kinds.

    .venv/bin/python -m benchmarks.retention_scan [--iterations 50 200 800] [--repeats 5]
"""

from __future__ import annotations

import argparse
import collections
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from storage import RunLayout, create_or_open_run, upload_checkpoint
from storage.manifest import commit_iteration
from storage.objects import ObjectStore
from storage.retention import KeepRule, apply, apply_after_commit
from storage.stages import StageOutput

KINDS = ("policy", "teacher", "megatron")


def grow(layout: RunLayout, weights: Path, start: int, stop: int) -> None:
    """Iterations start..stop, each with its three checkpoints and a commit."""
    for n in range(start, stop + 1):
        for stage in ("rollout", "teacher", "train"):
            output = StageOutput(layout, n, stage)
            output.write_json("x.json", {"n": n})
            output.commit()
        for kind in KINDS:
            upload_checkpoint(weights, layout, n, kind, parent="base")
        commit_iteration(layout, n, metrics={}, checkpoints=list(KINDS))


class Counted:
    """Counts the store's operations by name while installed."""

    def __init__(self) -> None:
        self.ops: collections.Counter[str] = collections.Counter()
        self._original = ObjectStore._call

    def __enter__(self) -> Counted:
        counter, original = self.ops, self._original

        def call(store: ObjectStore, fn: Any, what: str, url: str) -> Any:
            counter[what] += 1
            return original(store, fn, what, url)

        ObjectStore._call = call  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        ObjectStore._call = self._original  # type: ignore[method-assign]


def full_pass(layout: RunLayout, rule: KeepRule, repeats: int) -> tuple[float, dict[str, int]]:
    """`apply` (what `sdpo gc` runs) at the run's length: median seconds, the store operations of one."""

    def run() -> None:
        apply(layout, resumable=rule, weights=rule, eval_metric=lambda n, name: None)

    run()  # what this length prunes goes now; the timed passes find it gone
    with Counted() as counted:
        run()
    return statistics.median(_timed(run) for _ in range(repeats)), dict(counted.ops)


def after_commit(
    layout: RunLayout, weights: Path, rule: KeepRule, start: int, stop: int
) -> tuple[float, dict[str, int]]:
    """`apply_after_commit` (the flow's pass) after each of the commits start..stop: median seconds,
    the store operations of the last."""

    def run() -> None:
        apply_after_commit(layout, resumable=rule, weights=rule, eval_metric=lambda n, name: None)

    seconds = []
    for n in range(start, stop + 1):
        grow(layout, weights, n, n)
        if n < stop:
            seconds.append(_timed(run))
    with Counted() as counted:
        run()
    return statistics.median(seconds), dict(counted.ops)


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _ops(ops: dict[str, int]) -> str:
    listed = ops.get("list", 0) + ops.get("ls", 0)
    return f"{ops.get('exists', 0)} / {ops.get('read', 0)} / {listed} (all: {sum(ops.values())})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, nargs="+", default=[50, 200, 800])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rules = {"keep everything": KeepRule(), "last 2": KeepRule(last=2)}
    print(
        "| iterations | rules | full pass ms | its store operations | pass after a commit ms | its store operations |"
    )
    print("|---|---|---|---|---|---|")
    print("|  |  |  | exists / read / list |  | exists / read / list |")
    with tempfile.TemporaryDirectory(prefix="retention-scan-") as tmp:
        weights = Path(tmp) / "w"
        weights.mkdir()
        (weights / "model.safetensors").write_bytes(b"w" * 64)
        layouts = {}
        for name in rules:
            layouts[name] = RunLayout(f"file://{tmp}/{name.replace(' ', '-')}", "r")
            create_or_open_run(layouts[name], {"lr": 1.0})
            upload_checkpoint(weights, layouts[name], 0, "policy", parent="base")
        built = 0
        for length in sorted(args.iterations):
            for name, rule in rules.items():
                layout = layouts[name]
                grow(layout, weights, built + 1, length - args.repeats - 1)
                full_s, full_ops = full_pass(layout, rule, args.repeats)  # leaves the record at this length
                after_s, after_ops = after_commit(layout, weights, rule, length - args.repeats, length)
                print(
                    f"| {length} | {name} | {full_s * 1e3:.1f} | {_ops(full_ops)} | {after_s * 1e3:.2f} | {_ops(after_ops)} |",
                    flush=True,
                )
            built = length


if __name__ == "__main__":
    main()
