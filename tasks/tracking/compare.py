"""Runs side by side from what the store holds: evaluations, iteration metrics, stage seconds.

`sdpo compare RUN...` reads each run's committed iterations (their manifests' metrics) and
evaluations (`storage.stages.read_eval`) from the run root, prints one table of the runs and one of
greedy accuracy by iteration, and writes a plot: greedy accuracy against iteration and against the
run's cumulative seconds, and the rollout's mean response length against iteration. Seconds are
the sum of the stage and evaluation seconds the run recorded, so time a run spent stopped between
a kill and its resume does not count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GREEDY = "eval/greedy_accuracy"
ROLLOUT_LENGTH = "rollout/response_length_mean"
STAGE_SECONDS = ("rollout/stage_seconds", "teacher/stage_seconds", "train/stage_seconds")


@dataclass
class RunHistory:
    """One run's curves: evaluation metrics by checkpoint (0 = the initial model) and iteration
    metrics by iteration, with the cumulative seconds at each checkpoint."""

    name: str
    url: str
    config: dict[str, Any]
    fork: dict[str, Any] | None = None  # the fork record (`storage.fork`) of a forked run
    evals: dict[int, dict[str, float]] = field(default_factory=dict)
    iterations: dict[int, dict[str, float]] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """The legend's name of the run: its loss and seed, and for a fork its parent, the iteration
        it started from and the settings it changed (its curves up to there are its parent's)."""
        from storage.fork import describe_changes

        kind = self.config.get("loss", {}).get("type", "?")
        label = f"{self.name} ({kind}, seed {self.config.get('seed', '?')})"
        if self.fork is None:
            return label
        return f"{label}\n  fork of {self.fork['parent']} at {self.fork['iteration']}: {describe_changes(self.fork)}"

    def last(self) -> int:
        return max(self.iterations, default=0)


def read_history(root: str, run_name: str) -> RunHistory:
    """The committed history of run `run_name` under `root` (raises FileNotFoundError for no run)."""
    from storage.fork import read_fork
    from storage.layout import RunLayout, read_run_config
    from storage.manifest import iteration_committed, read_iteration_manifest, read_latest
    from storage.stages import read_eval

    layout = RunLayout(root, run_name)
    history = RunHistory(run_name, layout.run_url, read_run_config(layout), fork=read_fork(layout))
    latest = read_latest(layout) or 0
    elapsed = 0.0
    for n in range(latest + 1):
        if n > 0 and iteration_committed(layout, n):
            metrics = {k: v for k, v in read_iteration_manifest(layout, n).data["metrics"].items() if _number(v)}
            history.iterations[n] = metrics
            elapsed += sum(float(metrics.get(key, 0.0)) for key in STAGE_SECONDS)
        evaluated = read_eval(layout, n)
        if evaluated is not None:
            history.evals[n] = {k: float(v) for k, v in evaluated.items() if _number(v)}
            elapsed += history.evals[n].get("eval/seconds", 0.0)
        history.seconds[n] = elapsed
    return history


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def summary_rows(histories: list[RunHistory]) -> tuple[list[str], list[list[str]]]:
    """(header: "metric" and the run names, one row per metric): loss, seed, iterations, greedy
    accuracy of the base model, the last evaluation and the best one (with its iteration), the last
    evaluation's avg@n, pass@k and teacher accuracy, response lengths (last evaluation, last
    rollout) and the run's seconds. Runs are columns, so the table fits a terminal."""
    from tasks.tracking.summary import headline_keys

    finals = [h.evals[max(h.evals)] if h.evals else {} for h in histories]
    extra = [k for k in headline_keys(*finals) if k != GREEDY and k != "eval/response_length_mean"]

    def best(history: RunHistory) -> str:
        graded = {n: m[GREEDY] for n, m in history.evals.items() if GREEDY in m}
        if not graded:
            return "-"
        n = max(graded, key=lambda i: (graded[i], -i))
        return f"{graded[n]:.3f} ({n})"

    rows = [
        ["loss", *[str(h.config.get("loss", {}).get("type", "-")) for h in histories]],
        ["seed", *[str(h.config.get("seed", "-")) for h in histories]],
        ["iterations", *[str(h.last()) for h in histories]],
        ["greedy base", *[_fmt(h.evals.get(0, {}).get(GREEDY)) for h in histories]],
        ["greedy final", *[_fmt(f.get(GREEDY)) for f in finals]],
        ["greedy best (at)", *[best(h) for h in histories]],
        *[[_short(k), *[_fmt(f.get(k)) for f in finals]] for k in extra],
        ["eval length", *[_fmt(f.get("eval/response_length_mean"), 1) for f in finals]],
        ["rollout length", *[_fmt(h.iterations.get(h.last(), {}).get(ROLLOUT_LENGTH), 1) for h in histories]],
        ["seconds", *[f"{h.seconds.get(h.last(), 0.0):.1f}" for h in histories]],
    ]
    return ["metric", *[h.name for h in histories]], rows


def _short(key: str) -> str:
    """eval/avg_at_4 -> avg@4, eval/pass_at_2 -> pass@2, eval/teacher_accuracy -> teacher."""
    name = key.removeprefix("eval/")
    return name.replace("_at_", "@").replace("teacher_accuracy", "teacher")


def accuracy_rows(histories: list[RunHistory]) -> tuple[list[str], list[list[str]]]:
    """(header, one row per evaluated checkpoint): greedy accuracy of each run side by side."""
    steps = sorted({n for h in histories for n, m in h.evals.items() if GREEDY in m})
    header = ["iteration", *[h.name for h in histories]]
    rows = [[str(n), *[_fmt(h.evals.get(n, {}).get(GREEDY)) for h in histories]] for n in steps]
    return header, rows


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def write_plot(histories: list[RunHistory], path: Path) -> Path:
    """Greedy accuracy vs iteration, vs seconds, and rollout response length vs iteration, one line
    per run, named by `RunHistory.label` (a fork's dashed, its changed settings in the legend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for history in histories:
        # a fork's curves are dashed: up to its fork point they are its parent's, drawn over them
        style = {"label": history.label, "linestyle": "--" if history.fork is not None else "-"}
        steps = sorted(n for n, m in history.evals.items() if GREEDY in m)
        accuracy = [history.evals[n][GREEDY] for n in steps]
        axes[0].plot(steps, accuracy, marker="o", **style)
        axes[1].plot([history.seconds[n] for n in steps], accuracy, marker="o", **style)
        its = sorted(n for n, m in history.iterations.items() if ROLLOUT_LENGTH in m)
        axes[2].plot(its, [history.iterations[n][ROLLOUT_LENGTH] for n in its], **style)
    for ax, xlabel, ylabel in (
        (axes[0], "iteration", "eval greedy accuracy"),
        (axes[1], "seconds (stages + evaluation)", "eval greedy accuracy"),
        (axes[2], "iteration", "rollout mean response length (tokens)"),
    ):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylim(0, 1)
    axes[1].set_ylim(0, 1)
    axes[0].legend(fontsize=8)
    return save_figure(fig, path)


def save_figure(fig: Any, path: Path) -> Path:
    """Lay out, write (the folder made when missing) and close a matplotlib figure; returns `path`."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
