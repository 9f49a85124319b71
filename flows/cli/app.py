"""The `sdpo` Typer app, the arguments its commands share, and what every command needs first:
logging, Prefect's local mode, the checked config, failing with exit code 2."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

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
    list[str] | None, typer.Argument(help="dotted overrides, e.g. loss.alpha=0.5 rollout.group_size=4")
]
# Flags without a `--no-` twin: the options column of `--help` then fits 80 columns whole.
AllowChangeOpt = Annotated[
    bool,
    typer.Option(
        "--allow-config-change", help="continue an existing run under a changed config (the change is recorded)"
    ),
]
ForceUnlockOpt = Annotated[
    bool,
    typer.Option("--force-unlock", help="take over a run lock whose lease expired and whose holder did not heartbeat"),
]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="every stage's log lines")]


def setup_logging(verbose: bool) -> Any:
    """One line per iteration by default; every stage's log lines with --verbose. Returns the
    console the log lines go to (a progress bar on it keeps below them).

    On a terminal the lines are rich's, wrapped to its width; into a pipe or a file each record is
    one whole line with its time and level (rich would wrap it at 80 columns)."""
    from rich.console import Console
    from rich.logging import RichHandler

    from flows.orchestration import quiet_libraries

    console = Console(stderr=True)
    handler: logging.Handler
    if console.is_terminal:
        handler = RichHandler(console=console, show_path=False, rich_tracebacks=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, handlers=[handler], force=True)
    logging.getLogger("flows").setLevel(logging.INFO)
    if not verbose:
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
        quiet_libraries()
    return console


def output_console() -> Any:
    """The console a command prints its results on (stdout): on a terminal, wrapped to its width;
    into a pipe or a file, lines are written whole, so a printed command stays one line to copy."""
    from rich.console import Console

    console = Console()
    console.soft_wrap = not console.is_terminal
    return console


@contextlib.contextmanager
def prefect_local_mode(run_name: str, *, meanwhile: Callable[[], Any] | None = None):
    """Without PREFECT_API_URL, run on Prefect's ephemeral server and skip flow heartbeats.

    Each run gets its own Prefect home (.sdpo/prefect/<run>) unless PREFECT_HOME is set: two
    ephemeral servers writing one SQLite database lock each other out, and comparing an SDPO run
    with its baseline means running both at once. A new home starts from a migrated database
    (`flows.prefect_home`). Heartbeats exist to spot crashed runs on a real
    server; locally they only add a second of join time to every flow run.

    `meanwhile` (the imports the run will need) runs before the block. The ephemeral server is a
    process of its own that takes seconds to start (it imports Prefect's server and opens its
    database); it is started on a thread first, so that `meanwhile` runs while it starts, and the
    block's first Prefect call finds it up. A server that fails to start raises here. A guard
    process stops the server should this process be killed without running its `atexit` handlers,
    where Prefect stops it (`tasks.lifetime.guard`).
    """
    if os.environ.get("PREFECT_API_URL"):
        if meanwhile is not None:
            meanwhile()
        yield
        return
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # The ephemeral server's default 20 s start-up limit is missed on a loaded 2-core machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    if "PREFECT_HOME" not in os.environ:
        home = Path(".sdpo", "prefect", run_name).resolve()
        home.mkdir(parents=True, exist_ok=True)
        os.environ["PREFECT_HOME"] = str(home)
    from flows.prefect_home import seed_home

    seed_home(Path(os.environ["PREFECT_HOME"]).expanduser())
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        _start_ephemeral_server_during(meanwhile or (lambda: None))
        yield


def _start_ephemeral_server_during(work: Callable[[], Any]) -> None:
    """Start Prefect's ephemeral server on a thread while `work` runs here, and its guard; returns
    once both are done, raising either's error. Without PREFECT_API_URL `prefect.get_client` starts
    this same instance (`SubprocessASGIServer()` is one per process) and finds it running."""
    from concurrent.futures import ThreadPoolExecutor

    from prefect.server.api.server import SubprocessASGIServer

    from tasks.lifetime import guard

    server = SubprocessASGIServer()
    already = server.server_process is not None
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefect-server-start") as pool:
        started = pool.submit(server.start)
        work()
        started.result()
    if not already and server.server_process is not None:
        guard(server.server_process.pid)


CANCELLED_EXIT = 3  # the exit status of a command whose run was cancelled in Prefect


def fail(message: str | None) -> None:
    typer.secho(message, fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def announce_run(cfg: Any, config: Path, *, allow_config_change: bool) -> None:
    """Before a command that trains starts Prefect and imports its libraries (seconds): exit 2 with
    the old -> new differences when the run exists under another config and the change is not
    allowed, else say which run starts or resumes, so the first line comes at once."""
    from storage.errors import ConfigMismatchError
    from storage.manifest import read_latest
    from tasks.runtime import check_config_unchanged, run_layout

    layout = run_layout(cfg)
    if not allow_config_change:
        try:
            check_config_unchanged(cfg, layout)
        except ConfigMismatchError as err:
            fail(str(err))
    from storage.fork import describe_changes, read_fork

    latest = read_latest(layout)
    where = f"config {config}, {cfg.iterations} iterations, under {cfg.storage.root}"
    if latest is None:
        typer.echo(f"starting run {cfg.name} ({where})", err=True)
        return
    typer.echo(f"resuming run {cfg.name} at iteration {latest}/{cfg.iterations} ({where})", err=True)
    fork = read_fork(layout)
    if fork is not None:  # its first iterations are the parent's: said once, not as iterations just run
        typer.echo(
            f"  a fork of {fork['parent']}: iterations 1-{fork['iteration']} are its parent's "
            f"({describe_changes(fork)})",
            err=True,
        )


def load_checked(config: Path, overrides: list[str] | None) -> Any:
    """The validated config of a run to start, or exit 2 with the fields to fix: everything is
    checked (data, storage root, tokenizer limits) before Prefect, MLflow or a run folder sees it.
    The overrides become the flow run's parameters, so storage options are refused among them."""
    from tasks.config import ConfigError, load_config, refuse_flow_overrides
    from tasks.preflight import preflight

    try:
        cfg = load_config(config, overrides or [])
        refuse_flow_overrides(overrides or [], config_path=config)
        preflight(cfg)
    except ConfigError as err:
        fail(str(err))
    return cfg
