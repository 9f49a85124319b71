"""Commands that run: `sdpo run`, `advance`, `validate`, `stage`, `eval`, `test-time`, `prepare-data`."""

from __future__ import annotations

import shlex
import time
from functools import partial
from typing import TYPE_CHECKING, Annotated, Any

import typer

from flows.cli.app import (
    CANCELLED_EXIT,
    AllowChangeOpt,
    ConfigArg,
    ForceUnlockOpt,
    OverridesArg,
    VerboseOpt,
    announce_run,
    app,
    fail,
    load_checked,
    output_console,
    prefect_local_mode,
    setup_logging,
)

if TYPE_CHECKING:
    from prefect.client.schemas.objects import State


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
    started = time.monotonic()
    log_console = setup_logging(verbose)
    cfg = load_checked(config, overrides)
    announce_run(cfg, config, allow_config_change=allow_config_change)
    from flows.cli.tracking import ui_commands
    from flows.progress import iteration_progress
    from flows.run import import_libraries, sdpo_run
    from tasks.runtime import run_layout
    from tasks.tracking.summary import render_table

    with (
        prefect_local_mode(cfg.name, meanwhile=partial(import_libraries, cfg)),
        iteration_progress(run_layout(cfg), cfg.iterations, log_console),
    ):
        state: State[Any] = sdpo_run(
            str(config), list(overrides or []), allow_config_change, force_unlock, return_state=True
        )  # type: ignore[assignment]  # a sync flow called with return_state returns its State
    if state.is_cancelled():
        stop_cancelled(state, cfg, ["sdpo", "run", str(config), *(overrides or [])])
    summary = state.result()
    console = output_console()
    if summary is None:  # finished before this command: its summary as the store keeps it
        from storage.summary import read_run_summary

        console.print(state.message)
        stored = read_run_summary(run_layout(cfg))
        if stored is None:
            raise RuntimeError(f"run {cfg.name}: the flow run found it finished, but its summary.json is missing")
        summary = stored["summary"]
    console.print(render_table(summary))
    console.print(f"this `sdpo run` took {time.monotonic() - started:.1f} s (wall time)")
    console.print("\nInspect the run:")
    for line in ui_commands(cfg, summary.get("experiment_id")):  # the port of tracking.ui_url
        console.print(f"  {line}")
    console.print(f"  sdpo lineage {cfg.name} --root {cfg.storage.root}")
    console.print(f"  sdpo status {cfg.name} --root {cfg.storage.root}")


def stop_cancelled(state: State[Any], cfg: Any, command: list[str]) -> None:
    """End a command whose flow run ended Cancelled: one line and exit CANCELLED_EXIT when it was
    cancelled in Prefect (what, where the run stopped, the command that resumes it); exit 2 with the
    reason when it stood aside (another live writer holds the run)."""
    from flows.cancel import cancelled_in_prefect
    from flows.progress import stage_under_way
    from storage.manifest import read_latest
    from tasks.runtime import run_layout

    if not cancelled_in_prefect(state):
        fail(state.message)
    layout = run_layout(cfg)
    latest = min(read_latest(layout) or 0, cfg.iterations)
    at = stage_under_way(layout, latest, cfg.iterations)
    where = "after its last iteration" if at == "done" else f"in iteration {latest + 1} at its {at} stage"
    typer.secho(
        f"run {cfg.name} was cancelled in Prefect: stopped {where} ({latest} of {cfg.iterations} iterations "
        f"committed, the run lock released); resume it with: {shlex.join(command)}",
        fg=typer.colors.YELLOW,
        err=True,
    )
    raise typer.Exit(CANCELLED_EXIT)


@app.command()
def advance(
    config: ConfigArg,
    overrides: OverridesArg = None,
    allow_config_change: AllowChangeOpt = False,
    force_unlock: ForceUnlockOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Advance a run by one iteration (creating it if needed), as a scheduled deployment does."""
    setup_logging(verbose)
    cfg = load_checked(config, overrides)
    announce_run(cfg, config, allow_config_change=allow_config_change)
    from flows.iteration import sdpo_advance
    from flows.run import import_libraries

    with prefect_local_mode(cfg.name, meanwhile=partial(import_libraries, cfg)):
        state = sdpo_advance(str(config), list(overrides or []), allow_config_change, force_unlock, return_state=True)
    if state.is_cancelled():
        stop_cancelled(state, cfg, ["sdpo", "advance", str(config), *(overrides or [])])
    result = state.result()
    if result is None:
        typer.echo(state.message)
    else:
        typer.echo(f"run {cfg.name}: committed {result['path']}")


@app.command()
def validate(config: ConfigArg, overrides: OverridesArg = None) -> None:
    """Validate a config (with overrides; data, tokenizer and hub model checks) and print it fully
    resolved, defaults included. A hub model the hub could not be asked about is named in a warning."""
    import yaml

    from tasks.config import ConfigError, full_dict, load_config
    from tasks.preflight import preflight

    setup_logging(False)  # the checks' warnings, one line each
    try:
        cfg = load_config(config, overrides or [])  # credentials are refused here, so never printed
        preflight(cfg)
    except ConfigError as err:
        fail(str(err))
    typer.echo(yaml.safe_dump(full_dict(cfg), sort_keys=False))


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
    from tasks.launch import STAGES, leave_process_group, register_stage_options, run_stage
    from tasks.lifetime import watch_starter
    from tasks.preload import import_frozen, imports_of
    from tasks.runtime import open_run

    watch_starter()  # launched by a run's process: it ends when that process (or torchrun) has
    if name not in STAGES:
        fail(f"unknown stage {name!r}; stages are {', '.join(STAGES)}")
    setup_logging(verbose)
    register_stage_options(root)
    # the stage's libraries first, with the collector paused and then frozen (tasks/preload.py)
    import_frozen(imports_of(name, open_run(root, run_name).cfg))
    run_stage(name, root, run_name, iteration)
    leave_process_group()


@app.command("eval")
def evaluate(
    config: ConfigArg,
    overrides: OverridesArg = None,
    iteration: Annotated[
        int,
        typer.Option(
            help="checkpoint to evaluate: N = iteration N's, 0 = the initial model, -1 = the latest committed (LATEST)"
        ),
    ] = -1,
) -> None:
    """Evaluate a run's checkpoint on the held-out split: greedy accuracy, avg@n and pass@k of
    eval.sampled_n samples per prompt, response lengths, per data source when the split mixes them."""
    from tasks.config import ConfigError, load_config, refuse_flow_overrides

    setup_logging(False)  # before Prefect is imported: its log level is read then
    try:
        cfg = load_config(config, overrides or [])
        refuse_flow_overrides(overrides or [], config_path=config)  # they become the flow run's parameters
    except ConfigError as err:
        fail(str(err))
    from flows.evaluate import sdpo_eval

    with prefect_local_mode(cfg.name):
        metrics = sdpo_eval(str(config), list(overrides or []), iteration)
    for key, value in sorted(metrics.items()):
        typer.echo(f"{key}: {value:.4f}")


@app.command("test-time")
def test_time(
    config: ConfigArg,
    overrides: OverridesArg = None,
    force_unlock: ForceUnlockOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Test-time self-distillation: SDPO updates on single hard questions (the `test_time` section
    picks them) against best-of-k sampling of the base model with as many attempts; prints
    discovery@k and writes the plot (also an MLflow artifact and a Prefect artifact). Resumable:
    run it again after an interruption."""
    from rich.markdown import Markdown

    setup_logging(verbose)
    cfg = load_checked(config, overrides)
    from flows.test_time import discovery_markdown, sdpo_test_time
    from tasks.config import ConfigError
    from tasks.test_time import check_attacks

    try:
        check_attacks(cfg)
    except ConfigError as err:
        fail(str(err))

    with prefect_local_mode(cfg.name):
        record = sdpo_test_time(str(config), list(overrides or []), force_unlock)
    console = output_console()
    console.print(Markdown(discovery_markdown(cfg.name, record)))
    console.print(f"\nplot: {cfg.storage.cache_dir}/test_time/{cfg.name}.png (and the MLflow run's artifacts)")


@app.command("prepare-data")
def prepare_data(
    dataset: Annotated[
        str, typer.Option(help="sciknoweval | tooluse | toolalpaca | livecodebench | humaneval | mbpp | gsm8k | ...")
    ],
    input: Annotated[str, typer.Option("--input", help="input file or folder (path or URL)")],  # noqa: A002
    output: Annotated[str, typer.Option(help="output data set (path or URL; .jsonl or .parquet)")],
    eval_output: Annotated[str | None, typer.Option(help="also write a held-out / full-test split here")] = None,
    skip_invalid: Annotated[bool, typer.Option(help="skip malformed rows (counted) instead of failing")] = False,
    option: Annotated[list[str] | None, typer.Option(help="converter option key=value (repeatable)")] = None,
) -> None:
    """Convert a data set into the run's prompt schema (prompt messages, label, data source, metadata)."""
    from tasks.data.prepare import InvalidRowError, cli_prepare

    try:
        stats = cli_prepare(
            dataset, input, output, skip_invalid=skip_invalid, eval_output=eval_output, options=list(option or [])
        )
    except InvalidRowError as err:
        fail(str(err))
    for key, value in stats.items():
        typer.echo(f"{key}: {value}")
