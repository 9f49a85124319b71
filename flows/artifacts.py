"""Prefect artifacts of a run: per iteration a summary, a sample table and link artifacts to its
policy checkpoint and to the MLflow run (links in Prefect's artifact view, not text to copy); one
summary of the whole run at its end.

Keys are per SDPO run (`sdpo-<run>-iteration`, `sdpo-<run>-samples`, `sdpo-<run>-checkpoint`,
`sdpo-<run>-mlflow-run`, `sdpo-<run>-summary`), so Prefect's artifact view keeps every iteration as
a version of the same key.
"""

from __future__ import annotations

import logging
import re
from typing import Any

logger = logging.getLogger(__name__)

_CELL_CHARS = 400  # table cells beyond this are cut (teacher prompts run to kilobytes)


def artifact_key(run_name: str, what: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", f"sdpo-{run_name}-{what}".lower())


def markdown_artifact(markdown: str, *, key: str, description: str | None = None) -> None:
    """A markdown artifact of this flow run, once the scanner passes its text
    (`storage.credentials.check_record`: Prefect stores it, and shows it to anyone who sees the run)."""
    from prefect.artifacts import create_markdown_artifact

    from storage.credentials import check_record

    check_record({"markdown": markdown, "description": description}, record=f"Prefect artifact {key}")
    create_markdown_artifact(markdown, key=key, description=description)


def mlflow_run_link(tracker: Any) -> str | None:
    """The MLflow UI page of the tracker's run, in the UI's training view, or None when tracking is off
    or no UI is configured."""
    from tasks.tracking.experiment import TRAINING_VIEW

    if not tracker.enabled or tracker.ui_url is None:
        return None
    return f"{tracker.ui_url.rstrip('/')}/#/experiments/{tracker.experiment_id}/runs/{tracker.run_id}?{TRAINING_VIEW}"


def mlflow_experiment_link(ui_url: str, experiment_id: str) -> str:
    """The MLflow UI page of an experiment's runs, in the UI's training view (its runs table and
    charts, rather than the GenAI view a new browser may open on)."""
    from tasks.tracking.experiment import TRAINING_VIEW

    return f"{ui_url.rstrip('/')}/#/experiments/{experiment_id}/runs?{TRAINING_VIEW}"


def _cut(value: Any) -> Any:
    text = value if isinstance(value, str) else None
    if text is None or len(text) <= _CELL_CHARS:
        return value
    return text[:_CELL_CHARS] + f"... ({len(text)} chars)"


def _metric_rows(metrics: dict[str, float], prefixes: tuple[str, ...]) -> list[str]:
    return [f"| `{k}` | {v:.4g} |" for k, v in sorted(metrics.items()) if k.startswith(prefixes)]


def iteration_markdown(
    run: Any, n: int, metrics: dict[str, float], *, mlflow_link: str | None, checkpoint_url: str
) -> str:
    """Markdown of iteration n: reward and losses, teacher coverage, eval when measured, stage times, links."""
    from tasks.viewer import view_command

    stage_times = [
        f"| {stage} | {metrics[f'{stage}/stage_seconds']:.1f} |"
        for stage in ("rollout", "teacher", "train")
        if f"{stage}/stage_seconds" in metrics
    ]
    coverage = metrics.get("teacher/sample_mask_fraction", metrics.get("sdpo/sample_mask_fraction"))
    lines = [
        f"# {run.cfg.name}: iteration {n} of {run.cfg.iterations} ({run.cfg.loss.type} loss)",
        "",
        f"Teacher signal on **{coverage:.0%}** of samples." if coverage is not None else "No teacher signal recorded.",
        "",
        "| metric | value |",
        "|---|---|",
        *_metric_rows(
            metrics, ("rollout/reward", "rollout/accuracy", "loss/", "sdpo/", "grpo/", "train/loss", "eval/")
        ),
        "",
        "| stage | seconds |",
        "|---|---|",
        *stage_times,
        "",
        f"Checkpoint: [{checkpoint_url}]({checkpoint_url})",
        "",
        f"Samples and per-token credit: `{view_command(run.cfg.name, run.cfg.storage.root)}`",
        "",
        f"MLflow run: [{mlflow_link}]({mlflow_link})"
        if mlflow_link
        else "MLflow: tracking off or no `tracking.ui_url`",
    ]
    return "\n".join(lines)


def publish_iteration(run: Any, tracker: Any, n: int, metrics: dict[str, float], samples: list[dict[str, Any]]) -> None:
    """Iteration n's markdown summary (its links included), sample table and the links to its
    policy checkpoint and MLflow run, as Prefect artifacts of this flow run: an API call each."""
    from prefect.artifacts import create_link_artifact, create_table_artifact

    name = run.cfg.name
    checkpoint_url = run.layout.checkpoint_dir(n, "policy")
    link = mlflow_run_link(tracker)
    create_link_artifact(
        checkpoint_url,
        link_text=f"{name}: policy checkpoint of iteration {n}",
        key=artifact_key(name, "checkpoint"),
        description=f"{name} iteration {n}: the policy checkpoint",
    )
    if link is not None:
        create_link_artifact(
            link,
            link_text=f"{name}: MLflow run (training view)",
            key=artifact_key(name, "mlflow-run"),
            description=f"{name} iteration {n}: the MLflow run",
        )
    markdown_artifact(
        iteration_markdown(run, n, metrics, mlflow_link=link, checkpoint_url=checkpoint_url),
        key=artifact_key(name, "iteration"),
        description=f"{name} iteration {n}: metrics, teacher coverage, stage times",
    )
    create_table_artifact(
        [{k: _cut(v) for k, v in row.items()} for row in samples],
        key=artifact_key(name, "samples"),
        description=f"{name} iteration {n}: prompt, response, reward, feedback, teacher context",
    )


def publish_run(run: Any, tracker: Any, summary: dict[str, Any]) -> None:
    """The whole run's summary: accuracy before -> after, time per stage, links."""
    name = run.cfg.name
    link = mlflow_run_link(tracker)
    from tasks.tracking.summary import headline_keys

    rows = [
        f"| `{key}` | {summary['before'].get(key, float('nan')):.3f} | {summary['after'].get(key, float('nan')):.3f} |"
        for key in headline_keys(summary["before"], summary["after"])
    ]
    times = [f"| {stage} | {seconds:.1f} |" for stage, seconds in summary["stage_seconds"].items()]
    markdown = "\n".join(
        [
            f"# {name}: {run.cfg.iterations} iterations ({run.cfg.loss.type} loss)",
            "",
            "| metric | before | after |",
            "|---|---|---|",
            *rows,
            "",
            "| stage | seconds |",
            "|---|---|",
            *times,
            f"| stages and evaluations | {summary['seconds']:.1f} |",
            "",
            f"Run: [{run.layout.run_url}]({run.layout.run_url})",
            "",
            f"MLflow run: [{link}]({link})" if link else "MLflow: tracking off or no `tracking.ui_url`",
        ]
    )
    markdown_artifact(markdown, key=artifact_key(name, "summary"), description=f"{name}: the whole run")
