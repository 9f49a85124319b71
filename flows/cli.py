"""The `sdpo` command line."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(
    name="sdpo",
    help="Self-Distillation Policy Optimization: runs, evaluation and inspection.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)

ConfigArg = Annotated[Path, typer.Argument(help="YAML run config, e.g. configs/demo.yaml", exists=True, dir_okay=False)]
OverridesArg = Annotated[
    Optional[list[str]], typer.Argument(help="dotted overrides, e.g. loss.alpha=0.5 rollout.group_size=4")
]


def _setup_logging(verbose: bool) -> None:
    """One line per iteration by default; every stage's log lines with --verbose."""
    import warnings

    from rich.logging import RichHandler

    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(show_path=False, rich_tracebacks=False)],
        force=True,
    )
    logging.getLogger("flows").setLevel(logging.INFO)
    for noisy in ("httpx", "alembic", "mlflow", "urllib3", "botocore", "werkzeug", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if not verbose:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # per-checkpoint "Loading weights" bars, many per iteration
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
        # megatron-core warns at import about optional GPU libraries it does not need here
        warnings.filterwarnings("ignore", module=r"megatron\..*")
        warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*")


@contextlib.contextmanager
def prefect_local_mode(run_name: str):
    """Without PREFECT_API_URL, run on Prefect's ephemeral server and skip flow heartbeats.

    Each run gets its own Prefect home (.sdpo/prefect/<run>) unless PREFECT_HOME is set: two
    ephemeral servers writing one SQLite database lock each other out, and comparing an SDPO run
    with its baseline means running both at once. Heartbeats exist to spot crashed runs on a real
    server; locally they only add a second of join time to every flow run.
    """
    if os.environ.get("PREFECT_API_URL"):
        yield
        return
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if "PREFECT_HOME" not in os.environ:
        home = Path(".sdpo", "prefect", run_name).resolve()
        home.mkdir(parents=True, exist_ok=True)
        os.environ["PREFECT_HOME"] = str(home)
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


def _fail(message: str) -> None:
    typer.secho(message, fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


@app.command()
def run(
    config: ConfigArg,
    overrides: OverridesArg = None,
    allow_config_change: Annotated[
        bool, typer.Option(help="continue an existing run under a changed config (the change is recorded)")
    ] = False,
    force_unlock: Annotated[bool, typer.Option(help="take over a stale run lock")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Create or resume a run and iterate it to the configured number of iterations."""
    from rich.console import Console

    from tasks.config import ConfigError, load_config
    from tasks.preflight import preflight

    _setup_logging(verbose)
    try:  # everything is checked before Prefect, MLflow or a run folder sees the config
        cfg = load_config(config, overrides or [])
        preflight(cfg)
    except ConfigError as err:
        _fail(str(err))
    from flows.run import sdpo_run
    from tasks.summary import render_table

    with prefect_local_mode(cfg.name):
        summary = sdpo_run(str(config), list(overrides or []), allow_config_change, force_unlock)
    console = Console()
    console.print(render_table(summary))
    uri = summary["tracking_uri"]
    console.print("\nInspect the run:")
    console.print(f"  mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000")
    console.print(f"  sdpo lineage {cfg.name} --root {cfg.storage.root}")
    console.print(f"  sdpo status {cfg.name} --root {cfg.storage.root}")


@app.command()
def validate(config: ConfigArg, overrides: OverridesArg = None) -> None:
    """Validate a config (with overrides, data and tokenizer checks) and print it fully resolved, defaults included."""
    import yaml

    from tasks.config import ConfigError, load_config, to_dict
    from tasks.preflight import preflight

    try:
        cfg = load_config(config, overrides or [])  # credentials are refused here, so never printed
        preflight(cfg)
    except ConfigError as err:
        _fail(str(err))
    typer.echo(yaml.safe_dump(to_dict(cfg), sort_keys=False))


@app.command()
def lineage(
    run_name: Annotated[str, typer.Argument(help="run name")],
    root: Annotated[str, typer.Option(help="run root (path or URL)")] = "runs",
) -> None:
    """Print the checkpoint chain of a run: each checkpoint, its parent and the shards it was trained on."""
    from storage.checkpoints import format_lineage, lineage as read_lineage
    from storage.layout import RunLayout

    typer.echo(format_lineage(read_lineage(RunLayout(root, run_name))))


@app.command()
def status(
    run_name: Annotated[str, typer.Argument(help="run name")],
    root: Annotated[str, typer.Option(help="run root (path or URL)")] = "runs",
) -> None:
    """Print which iterations and stages of a run are committed."""
    from storage.layout import RunLayout
    from storage.manifest import read_latest, stage_done

    layout = RunLayout(root, run_name)
    latest = read_latest(layout) or 0
    typer.echo(f"run {layout.run_url}: LATEST = {latest}")
    n = latest + 1
    done = [stage for stage in ("rollout", "teacher", "train") if stage_done(layout, n, stage)]
    typer.echo(f"iteration {n}: committed stages: {', '.join(done) or 'none'}")


@app.command("eval")
def evaluate(
    config: ConfigArg,
    overrides: OverridesArg = None,
    iteration: Annotated[int, typer.Option(help="checkpoint to evaluate (0 = the initial model)")] = -1,
) -> None:
    """Evaluate a run's checkpoint on the held-out split (greedy and sampled accuracy)."""
    from flows.evaluate import sdpo_eval
    from tasks.config import ConfigError, load_config

    _setup_logging(False)
    try:
        cfg = load_config(config, overrides or [])
    except ConfigError as err:
        _fail(str(err))
    with prefect_local_mode(cfg.name):
        metrics = sdpo_eval(str(config), list(overrides or []), iteration)
    for key, value in sorted(metrics.items()):
        typer.echo(f"{key}: {value:.4f}")


@app.command("prepare-data")
def prepare_data(
    dataset: Annotated[str, typer.Option(help="sciknoweval | tooluse | toolalpaca | livecodebench | humaneval | mbpp | gsm8k | ...")],
    input: Annotated[str, typer.Option("--input", help="input file or folder (path or URL)")],  # noqa: A002
    output: Annotated[str, typer.Option(help="output data set (path or URL; .jsonl or .parquet)")],
    eval_output: Annotated[Optional[str], typer.Option(help="also write a held-out / full-test split here")] = None,
    skip_invalid: Annotated[bool, typer.Option(help="skip malformed rows (counted) instead of failing")] = False,
    option: Annotated[Optional[list[str]], typer.Option(help="converter option key=value (repeatable)")] = None,
) -> None:
    """Convert a data set into the run's prompt schema (prompt messages, label, data source, metadata)."""
    from tasks.prepare_data import InvalidRowError, cli_prepare

    try:
        stats = cli_prepare(
            dataset, input, output, skip_invalid=skip_invalid, eval_output=eval_output, options=list(option or [])
        )
    except InvalidRowError as err:
        _fail(str(err))
    for key, value in stats.items():
        typer.echo(f"{key}: {value}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
