"""The `sdpo` command line."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Annotated, Any, Optional

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
AllowChangeOpt = Annotated[
    bool, typer.Option(help="continue an existing run under a changed config (the change is recorded)")
]
ForceUnlockOpt = Annotated[
    bool, typer.Option(help="take over a run lock whose lease expired and whose holder did not heartbeat")
]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="every stage's log lines")]


def _setup_logging(verbose: bool) -> Any:
    """One line per iteration by default; every stage's log lines with --verbose. Returns the
    console the log lines go to (a progress bar on it keeps below them)."""
    from rich.console import Console
    from rich.logging import RichHandler

    from flows.orchestration import quiet_libraries

    console = Console(stderr=True)
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=console, show_path=False, rich_tracebacks=False)],
        force=True,
    )
    logging.getLogger("flows").setLevel(logging.INFO)
    if not verbose:
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
        quiet_libraries()
    return console


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
    # The ephemeral server's default 20 s start-up limit is missed on a loaded 2-core machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    if "PREFECT_HOME" not in os.environ:
        home = Path(".sdpo", "prefect", run_name).resolve()
        home.mkdir(parents=True, exist_ok=True)
        os.environ["PREFECT_HOME"] = str(home)
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


def _fail(message: str | None) -> None:
    typer.secho(message, fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _load(config: Path, overrides: list[str] | None) -> Any:
    """The validated config of a run to start, or exit 2 with the fields to fix: everything is
    checked (data, storage root, tokenizer limits) before Prefect, MLflow or a run folder sees it."""
    from tasks.config import ConfigError, load_config
    from tasks.preflight import preflight

    try:
        cfg = load_config(config, overrides or [])
        preflight(cfg)
    except ConfigError as err:
        _fail(str(err))
    return cfg


@app.command()
def run(
    config: ConfigArg,
    overrides: OverridesArg = None,
    allow_config_change: AllowChangeOpt = False,
    force_unlock: ForceUnlockOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Create or resume a run and iterate it to the configured number of iterations, with a progress
    bar (iteration and stage under way, ETA) and a summary table at the end."""
    from rich.console import Console

    log_console = _setup_logging(verbose)
    cfg = _load(config, overrides)
    from flows.progress import iteration_progress
    from flows.run import sdpo_run
    from tasks.runtime import run_layout
    from tasks.tracking.summary import render_table

    with prefect_local_mode(cfg.name), iteration_progress(run_layout(cfg), cfg.iterations, log_console):
        summary = sdpo_run(str(config), list(overrides or []), allow_config_change, force_unlock)
    console = Console()
    console.print(render_table(summary))
    uri = summary["tracking_uri"]
    console.print("\nInspect the run:")
    console.print(f"  mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000")
    console.print(f"  sdpo lineage {cfg.name} --root {cfg.storage.root}")
    console.print(f"  sdpo status {cfg.name} --root {cfg.storage.root}")


@app.command()
def advance(
    config: ConfigArg,
    overrides: OverridesArg = None,
    allow_config_change: AllowChangeOpt = False,
    force_unlock: ForceUnlockOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Advance a run by one iteration (creating it if needed), as a scheduled deployment does."""
    _setup_logging(verbose)
    cfg = _load(config, overrides)
    from flows.iteration import sdpo_advance

    with prefect_local_mode(cfg.name):
        state = sdpo_advance(str(config), list(overrides or []), allow_config_change, force_unlock, return_state=True)
    if state.is_cancelled():
        _fail(state.message)
    result = state.result()
    if result is None:
        typer.echo(f"{state.message}: nothing to do")
    else:
        typer.echo(f"run {cfg.name}: committed {result['path']}")


@app.command()
def validate(config: ConfigArg, overrides: OverridesArg = None) -> None:
    """Validate a config (with overrides, data and tokenizer checks) and print it fully resolved, defaults included."""
    import yaml

    from tasks.config import ConfigError, full_dict, load_config
    from tasks.preflight import preflight

    try:
        cfg = load_config(config, overrides or [])  # credentials are refused here, so never printed
        preflight(cfg)
    except ConfigError as err:
        _fail(str(err))
    typer.echo(yaml.safe_dump(full_dict(cfg), sort_keys=False))


@app.command()
def lineage(
    run_name: Annotated[str, typer.Argument(help="run name")],
    root: Annotated[str, typer.Option(help="run root (path or URL)")] = "runs",
) -> None:
    """Print the checkpoint chain of a run: each checkpoint, its parent and the shards it was trained on
    (and, for a fork, the run and iteration it started from)."""
    from storage.checkpoints import format_lineage, lineage as read_lineage
    from storage.fork import read_fork
    from storage.layout import RunLayout

    layout = RunLayout(root, run_name)
    fork = read_fork(layout)
    title = None
    if fork is not None:
        title = f"{run_name}: forked from {fork['parent_run_url']} at iteration {fork['iteration']} (iteration manifest {fork['iteration_manifest_sha256'][:12]})"
    typer.echo(format_lineage(read_lineage(layout), title=title))


@app.command()
def fork(
    run_name: Annotated[str, typer.Argument(help="the run to fork")],
    from_iteration: Annotated[int, typer.Option("--from-iteration", help="committed iteration of RUN to start from")],
    name: Annotated[str, typer.Option("--name", help="name of the new run")],
    overrides: OverridesArg = None,
    root: Annotated[str, typer.Option(help="run root of RUN (path or URL)")] = "runs",
    config_out: Annotated[
        Optional[Path], typer.Option(help="where to write the new run's config (default: NAME.yaml)")
    ] = None,
) -> None:
    """Start a new run from a committed iteration of another: its checkpoints (policy, teacher,
    optimizer state), data cursor and history, with the parent recorded in the fork's lineage and
    MLflow run. Without overrides the fork's next iteration is the parent's, bit for bit."""
    import yaml

    from storage.fork import fork_run
    from storage.layout import RunLayout, read_run
    from storage.lock import RunLock
    from tasks.config import ConfigError, apply_overrides, build_config, to_dict

    parent = RunLayout(root, run_name)
    if not parent.store.exists(parent.run_json):
        _fail(f"no run {run_name!r} under {parent.root_url} (no {parent.run_json})")
    out = config_out or Path(f"{name}.yaml")
    if out.exists():
        _fail(f"{out} exists; pass --config-out to write the fork's config elsewhere")
    tree = read_run(parent)["config"]
    tree["name"] = name
    try:
        cfg = build_config(apply_overrides(tree, list(overrides or [])))
    except ConfigError as err:
        _fail(str(err))
    from tasks.runtime import run_layout

    child = run_layout(cfg)
    try:
        with RunLock(child, lease_seconds=cfg.storage.lock_lease_seconds):
            fork_run(parent, child, iteration=from_iteration, config=to_dict(cfg))
    except (ValueError, FileExistsError) as err:
        _fail(str(err))
    out.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    typer.echo(f"run {child.run_url}: forked from {parent.run_url} at iteration {from_iteration}; config in {out}")
    typer.echo(f"continue it with: sdpo run {out}")


@app.command()
def status(
    run_name: Annotated[str, typer.Argument(help="run name")],
    root: Annotated[str, typer.Option(help="run root (path or URL)")] = "runs",
) -> None:
    """Print where a run stands: LATEST (its digest checked), the target, the lock holder, the next
    iteration's committed stages, and whether it is complete, in progress or stopped (at which stage)."""
    from flows.progress import stage_under_way
    from storage.errors import StorageError
    from storage.layout import RunLayout, read_run
    from storage.lock import read_lock_holder
    from storage.manifest import stage_done, verify_latest

    layout = RunLayout(root, run_name)
    if not layout.store.exists(layout.run_json):
        _fail(f"no run {run_name!r} under {layout.root_url} (no {layout.run_json})")
    target = int(read_run(layout)["config"]["iterations"])
    try:
        latest = verify_latest(layout) or 0
    except StorageError as err:
        _fail(f"run {layout.run_url}: LATEST does not check out: {err}")
    holder = read_lock_holder(layout)
    typer.echo(f"run {layout.run_url}: LATEST = {latest} of {target} iterations (digest verified)")
    if holder is None:
        typer.echo("lock: free")
    else:
        stale = holder.stale_reason()
        typer.echo(f"lock: held by {holder.describe()}" + (f" (stale: {stale})" if stale else ""))
    if latest >= target:
        typer.echo("complete")
        return
    n = latest + 1
    done = [stage for stage in ("rollout", "teacher", "train") if stage_done(layout, n, stage)]
    typer.echo(f"iteration {n}: committed stages: {', '.join(done) or 'none'}")
    at = stage_under_way(layout, latest, target)
    if holder is not None and holder.stale_reason() is None:
        typer.echo(f"in progress: iteration {n}, {at} under way")
    else:
        typer.echo(f"stopped in iteration {n} at {at}; the next run or tick resumes there")


@app.command()
def verify(
    run_name: Annotated[str, typer.Argument(help="run name")],
    root: Annotated[str, typer.Option(help="run root (path or URL)")] = "runs",
) -> None:
    """Re-hash every committed shard, checkpoint file and manifest of a run against the manifests
    (and LATEST against its iteration manifest); exits 1 when anything is damaged or missing."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    from storage.layout import RunLayout
    from storage.verify import committed_bytes, verify_run

    layout = RunLayout(root, run_name)
    columns = ("{task.description}", BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task(f"verifying {run_name}", total=committed_bytes(layout))
        report = verify_run(layout, progress=lambda n: bar.advance(task, n))
    typer.echo(
        f"run {layout.run_url}: {report.manifests} manifests, {report.files} files, "
        f"{report.bytes / 2**20:.1f} MiB checked"
    )
    if report.uncommitted:
        typer.echo(f"{len(report.uncommitted)} folder(s) without a manifest (an interrupted attempt; not part of the run):")
        for folder in report.uncommitted:
            typer.echo(f"  {folder}")
    if report.ok:
        typer.echo("OK: everything committed matches its manifests")
        return
    typer.secho(f"{len(report.problems)} problem(s):", fg=typer.colors.RED, err=True)
    for url, what in report.problems:
        typer.secho(f"  {url}: {what}", fg=typer.colors.RED, err=True)
    raise typer.Exit(1)


@app.command()
def gc(
    run_name: Annotated[str, typer.Argument(help="run name")],
    root: Annotated[str, typer.Option(help="run root (path or URL)")] = "runs",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the plan, delete nothing")] = False,
) -> None:
    """Apply the run's checkpoint retention (storage.retention): keep what it says and what a resume
    needs, remove the files of the rest (manifests stay, so lineage and verify still check them)."""
    from rich.console import Console
    from rich.table import Table

    from storage.lock import RunLock
    from tasks.runtime import apply_retention, open_run

    run = open_run(root, run_name)
    if dry_run:
        decisions = apply_retention(run, dry_run=True)
    else:
        with RunLock(run.layout, lease_seconds=run.cfg.storage.lock_lease_seconds):
            decisions = apply_retention(run)
    table = Table(title=f"retention of {run.layout.run_url}" + (" (dry run)" if dry_run else ""))
    for column in ("iteration", "kind", "MiB", "decision", "why"):
        table.add_column(column)
    for d in decisions:
        table.add_row(str(d.iteration), d.kind, f"{d.bytes / 2**20:.1f}", "keep" if d.keep else "prune", d.reason)
    console = Console()
    console.print(table)
    freed = sum(d.bytes for d in decisions if not d.keep)
    console.print(f"{'would free' if dry_run else 'freed'} {freed / 2**20:.1f} MiB")


@app.command("stage")
def stage_command(
    name: Annotated[str, typer.Argument(help="prepare-base | rollout | teacher | train | commit | eval")],
    root: Annotated[str, typer.Option(help="run root (path or URL)")],
    run_name: Annotated[str, typer.Option("--run", "--run-name", help="run name")],
    iteration: Annotated[int, typer.Option(help="iteration whose stage to run")],
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="every log line of the stage")] = False,
) -> None:
    """Run one stage of one iteration as a process: read its inputs from the store, write its outputs
    and manifest there. The stage launchers start this (under torchrun too); so can any scheduler."""
    from tasks.launch import STAGES, register_stage_options, run_stage

    if name not in STAGES:
        _fail(f"unknown stage {name!r}; stages are {', '.join(STAGES)}")
    _setup_logging(verbose)
    register_stage_options(root)
    run_stage(name, root, run_name, iteration)


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
    from tasks.data.prepare import InvalidRowError, cli_prepare

    try:
        stats = cli_prepare(
            dataset, input, output, skip_invalid=skip_invalid, eval_output=eval_output, options=list(option or [])
        )
    except InvalidRowError as err:
        _fail(str(err))
    for key, value in stats.items():
        typer.echo(f"{key}: {value}")


@app.command()
def view(
    run_name: Annotated[str, typer.Argument(help="run name")],
    root: Annotated[str, typer.Option(help="run root (path or URL, e.g. s3://bucket/runs)")] = "runs",
    port: Annotated[int, typer.Option(help="port of the web viewer")] = 8765,
    host: Annotated[str, typer.Option(help="interface to bind; the default serves this machine only")] = "127.0.0.1",
    tui: Annotated[bool, typer.Option("--tui", help="the terminal viewer instead of the web page")] = False,
) -> None:
    """Browse a run's rollouts: samples, groups, teacher context and the teacher's per-token credit (read-only)."""
    from tasks.viewer.data import RunData

    _setup_logging(False)
    try:
        data = RunData(root, run_name)
    except FileNotFoundError as err:  # no run.json under root
        _fail(str(err))
    if tui:
        from tasks.viewer.tui import ViewerApp

        ViewerApp(data).run()
        return
    from tasks.viewer.app import serve

    typer.echo(f"sdpo view: http://{host}:{port}/ (run {data.layout.run_url}, read-only; Ctrl-C stops)")
    serve(data, host=host, port=port)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
