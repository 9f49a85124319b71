"""The end-of-run summary: the table the CLI prints, and the artifacts logged to MLflow."""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.runtime import Run

logger = logging.getLogger(__name__)

STAGE_SECONDS = {
    "rollout": "rollout/stage_seconds",
    "teacher": "teacher/stage_seconds",
    "train": "train/stage_seconds",
}


@dataclass
class RunSummary:
    run_url: str
    tracking_uri: str
    loss_type: str
    experiment_id: str | None = None  # the MLflow experiment (None with tracking off)
    base_info: dict[str, Any] = field(default_factory=dict)
    before: dict[str, float] = field(default_factory=dict)
    after: dict[str, float] = field(default_factory=dict)
    iterations: dict[int, dict[str, float]] = field(default_factory=dict)
    seconds: float = 0.0

    def add_iteration(self, n: int, metrics: dict[str, float]) -> None:
        self.iterations[n] = dict(metrics)

    def record(self, n: int, metrics: dict[str, float]) -> None:
        """Step n's metrics: the base model's evaluation (n = 0) or iteration n's."""
        if n == 0:
            self.before = dict(metrics)
        else:
            self.add_iteration(n, metrics)

    def close(self, last: int) -> None:
        """The accuracy after the run (the evaluation of iteration `last`), and the seconds its stages
        and evaluations took, over every iteration whichever process ran it (not a wall time: a
        resumed run's earlier sessions count, the time between stages does not)."""
        final = self.iterations.get(last, self.before)
        self.after = {k: v for k, v in final.items() if k.startswith("eval/")}
        steps = [self.before, *self.iterations.values()]
        self.seconds = sum(self.stage_seconds().values()) + sum(m.get("eval/seconds", 0.0) for m in steps)

    def stage_seconds(self) -> dict[str, float]:
        return {stage: sum(m.get(key, 0.0) for m in self.iterations.values()) for stage, key in STAGE_SECONDS.items()}

    def as_dict(self) -> dict[str, Any]:
        return {
            "run_url": self.run_url,
            "tracking_uri": self.tracking_uri,
            "loss_type": self.loss_type,
            "experiment_id": self.experiment_id,
            "base": self.base_info,
            "before": self.before,
            "after": self.after,
            "iterations": {str(k): v for k, v in sorted(self.iterations.items())},
            "stage_seconds": self.stage_seconds(),
            "seconds": self.seconds,
        }

    def write_artifacts(self, run: Run, tracker: Any) -> None:
        """Resolved config, per-iteration metrics and the reward/accuracy plot (the sample tables are
        logged per iteration, `Tracker.log_samples`)."""
        from tasks.config import to_dict

        with tempfile.TemporaryDirectory(prefix="sdpo-artifacts-") as tmp:
            out = Path(tmp)
            (out / "config.json").write_text(json.dumps(to_dict(run.cfg), indent=2))
            (out / "summary.json").write_text(json.dumps(self.as_dict(), indent=2))
            if self.iterations:
                plot_curves(self, out / "reward_accuracy.png")
            for path in sorted(out.iterdir()):
                tracker.log_artifact(path)
            tracker.set_tags(
                {
                    "sdpo.config_url": run.layout.run_json,
                    "sdpo.latest_checkpoint": run.layout.checkpoint_dir(max(self.iterations or {0: None}), "policy"),
                }
            )


def sample_table(run: Run, iteration: int, *, limit: int = 24) -> list[dict[str, Any]]:
    """The first samples of an iteration: prompt, response, reward, feedback, teacher prompt, mask."""
    from storage.shard_reader import read_stage_columns

    cols = read_stage_columns(
        run.layout,
        iteration,
        "teacher",
        columns=[
            "group_id",
            "prompt_messages",
            "response_text",
            "reward",
            "feedback",
            "teacher_prompt_text",
            "teacher_source",
            "sample_mask",
        ],
        verify=run.cfg.storage.verify_sha256,
    )
    rows = []
    for i in range(min(limit, len(cols["group_id"]))):
        rows.append(
            {
                "group_id": int(cols["group_id"][i]),
                "prompt": cols["prompt_messages"][i][-1]["content"],
                "response": cols["response_text"][i],
                "reward": float(cols["reward"][i]),
                "feedback": cols["feedback"][i],
                "teacher_source": cols["teacher_source"][i],
                "sample_mask": bool(cols["sample_mask"][i]),
                "teacher_prompt": cols["teacher_prompt_text"][i],
            }
        )
    return rows


def plot_curves(summary: RunSummary, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(summary.iterations)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(
        steps, [summary.iterations[s].get("rollout/reward_mean", float("nan")) for s in steps], label="rollout reward"
    )
    evals = [s for s in steps if "eval/greedy_accuracy" in summary.iterations[s]]
    xs = [0, *evals]
    ax.plot(
        xs,
        [summary.before.get("eval/greedy_accuracy", float("nan"))]
        + [summary.iterations[s]["eval/greedy_accuracy"] for s in evals],
        marker="o",
        label="eval greedy accuracy",
    )
    ax.set_xlabel("iteration")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def headline_keys(*steps: dict[str, float]) -> list[str]:
    """The evaluation metrics a summary shows, in order: greedy accuracy, avg@n, pass@k by k, the
    teacher's accuracy, response length (over all prompts; per-source keys stay in MLflow)."""
    present = {key for metrics in steps for key in metrics if key.count("/") == 1 and key.startswith("eval/")}

    def order(key: str) -> tuple[int, int]:
        name = key.removeprefix("eval/")
        for rank, stem in enumerate(("greedy_accuracy", "avg_at_", "pass_at_", "teacher_accuracy")):
            if name.startswith(stem):
                suffix = name.removeprefix(stem)
                return rank, int(suffix) if suffix.isdigit() else 0
        return 9, 0

    keys = [k for k in present if order(k)[0] < 9]
    keys += ["eval/response_length_mean"] if "eval/response_length_mean" in present else []
    return sorted(keys, key=order)


def render_table(summary: dict[str, Any]) -> Any:
    """A rich table: accuracy before -> after and time per stage."""
    from rich.table import Table

    table = Table(title=f"{summary['loss_type'].upper()} run {summary['run_url']}")
    table.add_column("metric")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    for key in headline_keys(summary["before"], summary["after"]):
        table.add_row(
            key, f"{summary['before'].get(key, float('nan')):.3f}", f"{summary['after'].get(key, float('nan')):.3f}"
        )
    for stage, seconds in summary["stage_seconds"].items():
        table.add_row(f"time in {stage} (s)", "", f"{seconds:.1f}")
    table.add_row("time in stages and evaluations (s)", "", f"{summary['seconds']:.1f}")
    return table
