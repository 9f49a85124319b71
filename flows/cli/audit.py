"""Commands that look at runs and look after them: `sdpo lineage`, `fork`, `status`, `verify`, `gc`, `view`,
`compare`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from flows.cli.app import (
    OverridesArg,
    app,
    fail,
    output_console,
    setup_logging,
)


@app.command()
def lineage(
    run_name: Annotated[str, typer.Argument(help="run name")],
    root: Annotated[str, typer.Option(help="run root (path or URL)")] = "runs",
) -> None:
    """Print the checkpoint chain of a run: each checkpoint, its parent and the shards it was trained on
    (and, for a fork, the run and iteration it started from)."""
    from storage.checkpoints import format_lineage
    from storage.checkpoints import lineage as read_lineage
    from storage.fork import describe_changes, read_fork
    from storage.layout import RunLayout

    layout = RunLayout(root, run_name)
    fork = read_fork(layout)
    title = None
    if fork is not None:
        title = (
            f"{run_name}: forked from {fork['parent_run_url']} at iteration {fork['iteration']} (iteration manifest "
            f"{fork['iteration_manifest_sha256'][:12]}; {describe_changes(fork)})"
        )
    typer.echo(format_lineage(read_lineage(layout), title=title))


@app.command()
def fork(
    run_name: Annotated[str, typer.Argument(help="the run to fork")],
    from_iteration: Annotated[int, typer.Option("--from-iteration", help="committed iteration of RUN to start from")],
    name: Annotated[str, typer.Option("--name", help="name of the new run")],
    overrides: OverridesArg = None,
    root: Annotated[str, typer.Option(help="run root of RUN (path or URL)")] = "runs",
    config_out: Annotated[
        Path | None, typer.Option(help="where to write the new run's config (default: NAME.yaml)")
    ] = None,
) -> None:
    """Start a new run from a committed iteration of another: its checkpoints (policy, teacher,
    optimizer state), data cursor and history, with the parent recorded in the fork's lineage and
    MLflow run. Without overrides the fork's next iteration is the parent's, bit for bit."""
    import yaml

    from storage.fork import fork_run
    from storage.layout import RunLayout, read_run
    from storage.lock import RunLock
    from tasks.config import ConfigError, apply_overrides, build_config, stored_tree, to_dict

    parent = RunLayout(root, run_name)
    if not parent.store.exists(parent.run_json):
        fail(f"no run {run_name!r} under {parent.root_url} (no {parent.run_json})")
    out = config_out or Path(f"{name}.yaml")
    if out.exists():
        fail(f"{out} exists; pass --config-out to write the fork's config elsewhere")
    tree = stored_tree(read_run(parent)["config"])
    tree["name"] = name
    try:
        cfg = build_config(apply_overrides(tree, list(overrides or [])))
    except ConfigError as err:
        fail(str(err))
    from tasks.runtime import run_layout

    child = run_layout(cfg)
    try:
        with RunLock(child, lease_seconds=cfg.storage.lock_lease_seconds):
            fork_run(parent, child, iteration=from_iteration, config=to_dict(cfg))
    except (ValueError, FileExistsError) as err:
        fail(str(err))
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
        fail(f"no run {run_name!r} under {layout.root_url} (no {layout.run_json})")
    target = int(read_run(layout)["config"]["iterations"])
    try:
        latest = verify_latest(layout) or 0
    except StorageError as err:
        fail(f"run {layout.run_url}: LATEST does not check out: {err}")
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
    compare: Annotated[
        str | None, typer.Option("--compare", metavar="OTHER", help="a run of the same config to compare with")
    ] = None,
    compare_root: Annotated[str | None, typer.Option(help="run root of the --compare run (default: --root)")] = None,
    tracking_uri: Annotated[
        str | None,
        typer.Option(
            help="the MLflow tracking store that holds the run's recorded digests (default: the one its run.json "
            "names, or the SQLite store beside a local root)"
        ),
    ] = None,
) -> None:
    """Re-hash every committed shard, checkpoint file and manifest of a run against the manifests
    (and LATEST against its iteration manifest); exits 1 when anything is damaged or missing.

    With --compare OTHER, also compare the run with OTHER file by file: two runs of one config
    commit the same bytes but for the wall-clock fields of their manifests and records, which
    docs/reliability.md lists and the comparison alone leaves out; exits 1 on any other difference."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    from storage.layout import RunLayout
    from storage.verify import committed_bytes, verify_run

    layout = RunLayout(root, run_name)
    differences = None if compare is None else _compare(layout, RunLayout(compare_root or root, compare))
    departures = _anchors(layout, tracking_uri)
    columns = ("{task.description}", BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task(f"verifying {run_name}", total=committed_bytes(layout))
        report = verify_run(layout, progress=lambda n: bar.advance(task, n))
    if departures:
        url, what = departures[0]
        typer.secho(f"first manifest that departs from its anchors: {url} {what}", fg="red", err=True)
        report.problems[:0] = departures
    typer.echo(
        f"run {layout.run_url}: {report.manifests} manifests, {report.files} files, "
        f"{report.bytes / 2**20:.1f} MiB checked"
    )
    if report.uncommitted:
        typer.echo(
            f"{len(report.uncommitted)} folder(s) without a manifest (an interrupted attempt; not part of the run):"
        )
        for folder in report.uncommitted:
            typer.echo(f"  {folder}")
    if report.ok:
        typer.echo("OK: everything committed matches its manifests")
    else:
        typer.secho(f"{len(report.problems)} problem(s):", fg=typer.colors.RED, err=True)
        for url, what in report.problems:
            typer.secho(f"  {url}: {what}", fg=typer.colors.RED, err=True)
    if differences is not None:
        for note in differences.notes:  # how each run went: said apart, never a failure
            typer.echo(f"note, not a difference: {note}")
        if differences.differences:
            typer.secho(f"{len(differences.differences)} difference(s) from {compare}:", fg=typer.colors.RED, err=True)
            for line in differences.differences:
                typer.secho(f"  {line}", fg=typer.colors.RED, err=True)
        else:
            typer.echo(f"OK: the same files as {compare}, byte for byte but for the wall-clock fields of its records")
    if not report.ok or (differences is not None and differences.differences):
        raise typer.Exit(1)


def recorded_digests(tracking_uri: str, experiment: str, run_url: str) -> tuple[str, dict[str, str]] | None:
    """(MLflow run id, the digests it records) of the SDPO run at `run_url`, or None when the tracking
    store holds no such run. Reads only."""
    from mlflow.tracking import MlflowClient

    from tasks.tracking.anchor import recorded_in
    from tasks.tracking.experiment import RUN_URL_TAG

    client = MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return None
    runs = client.search_runs([found.experiment_id], filter_string=f"tags.`{RUN_URL_TAG}` = '{run_url}'", max_results=1)
    return None if not runs else (runs[0].info.run_id, recorded_in(runs[0].data.tags))


def _anchors(layout: Any, tracking_uri: str | None) -> list[tuple[str, str]]:
    """Say what anchors the run's audit trail (its MLflow run's recorded digests, the signing key, or
    nothing) and return the manifests that depart from them, first edited first."""
    from storage import anchor
    from storage.departures import departures

    if not layout.store.exists(layout.run_json):
        return []  # verify_run reports the missing run
    uri = tracking_uri or _tracking_uri_of(layout)
    found = None if uri is None else recorded_digests(uri, _experiment_of(layout), layout.run_url)
    recorded = found[1] if found is not None and found[1] else None
    signed = anchor.signing_key() is not None
    if found is not None and recorded is not None:
        typer.echo(f"anchored: {len(recorded)} manifest digests recorded in MLflow run {found[0]} ({uri})")
    if signed:
        typer.echo(f"signed: every manifest's signature is checked under {anchor.SIGNING_KEY_ENV}")
    if recorded is None and not signed:
        typer.echo(
            "unanchored: no tracking record of this run and no signing key ("
            + anchor.SIGNING_KEY_ENV
            + "): the check proves the files match the manifests and the manifests their digests, up to LATEST, "
            "which catches accidents; whoever can write the store can edit a manifest and recompute them"
        )
    return departures(layout, recorded) if recorded is not None or signed else []


def _tracking_uri_of(layout: Any) -> str | None:
    """The tracking URI the run's config names (None with tracking off): its run.json's, else the SQLite
    store beside a local root, or in .sdpo of the working directory for an object-store root."""
    from pathlib import Path

    from storage.layout import read_run_config

    tracking = read_run_config(layout).get("tracking", {})
    if not tracking.get("enabled", True):
        return None
    if tracking.get("uri"):
        return str(tracking["uri"])
    base = Path(layout.store.path(layout.root_url)) if layout.store.backend == "file" else Path(".sdpo")
    db = base / "mlflow.db"
    return f"sqlite:///{db.resolve()}" if db.is_file() else None


def _experiment_of(layout: Any) -> str:
    from storage.layout import read_run_config

    return str(read_run_config(layout).get("tracking", {}).get("experiment", "sdpo"))


def _compare(layout: Any, other: Any) -> Any:
    """`storage.compare.compare_runs`, failing with a message when either run does not exist."""
    from storage.compare import Comparison, compare_runs
    from storage.errors import StorageError

    for run in (layout, other):
        if not run.store.exists(run.run_json):
            fail(f"no run {run.run_name!r} under {run.root_url} (no {run.run_json})")
    comparison = Comparison()
    try:
        comparison = compare_runs(layout, other)
    except StorageError as err:
        fail(f"cannot compare {layout.run_url} with {other.run_url}: {err}")
    return comparison


@app.command()
def gc(
    run_name: Annotated[str, typer.Argument(help="run name")],
    root: Annotated[str, typer.Option(help="run root (path or URL)")] = "runs",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the plan, delete nothing")] = False,
) -> None:
    """Apply the run's checkpoint retention (storage.retention): keep what it says and what a resume
    needs, remove the files of the rest (manifests stay, so lineage and verify still check them)."""
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
    console = output_console()
    console.print(table)
    freed = sum(d.bytes for d in decisions if not d.keep)
    console.print(f"{'would free' if dry_run else 'freed'} {freed / 2**20:.1f} MiB")
    if freed == 0:
        console.print(_nothing_to_free(run.cfg.storage.retention))


def _nothing_to_free(retention: Any) -> str:
    """What to set when retention keeps every checkpoint: the rules in `storage.retention`."""
    rules = {kind: getattr(retention, kind).model_dump(exclude_none=True) for kind in ("resumable", "weights")}
    how = (
        "storage.retention.resumable.last=N (the full training state, the largest files) or "
        "storage.retention.weights.last=N (the HF weights), or their `every` / `best` clauses, in the run's "
        "config (`sdpo run CONFIG --allow-config-change storage.retention.resumable.last=1`, then `sdpo gc` again)"
    )
    if not any(rules.values()):
        return f"nothing to free: storage.retention sets no rule, so every checkpoint keeps its files; set {how}"
    set_now = "; ".join(f"{kind}: {rule or 'keep all'}" for kind, rule in rules.items())
    return (
        f"nothing to free: storage.retention ({set_now}) keeps every committed checkpoint, or a resume needs it; "
        f"to free more, narrow {how}"
    )


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

    setup_logging(False)
    try:
        data = RunData(root, run_name)
    except FileNotFoundError as err:  # no run.json under root
        fail(str(err))
    if tui:
        from tasks.viewer.tui import ViewerApp

        ViewerApp(data).run()
        return
    from tasks.viewer.app import serve

    typer.echo(f"sdpo view: http://{host}:{port}/ (run {data.layout.run_url}, read-only; Ctrl-C stops)")
    serve(data, host=host, port=port)


@app.command()
def compare(
    run_names: Annotated[list[str], typer.Argument(help="runs to compare, e.g. sdpo-seed1 grpo-seed1")],
    root: Annotated[str, typer.Option(help="run root of the runs (path or URL)")] = "runs",
    plot: Annotated[
        Path, typer.Option(help="where to write the plot (accuracy vs iteration and seconds, response length)")
    ] = Path("compare.png"),
) -> None:
    """Runs side by side: base, final and best held-out accuracy, avg@n and pass@k, response lengths,
    seconds; greedy accuracy by iteration; and a plot of the curves (all read from the run root). A
    fork is named with its parent and the settings it changed, and drawn dashed."""
    from rich.table import Table

    from storage.fork import describe_changes
    from tasks.tracking.compare import accuracy_rows, read_history, summary_rows, write_plot

    histories = []
    for name in run_names:
        try:
            histories.append(read_history(root, name))
        except FileNotFoundError as err:  # no run.json under root
            fail(str(err))
    console = output_console()
    for title, (header, rows) in (
        ("runs", summary_rows(histories)),
        ("eval greedy accuracy by iteration", accuracy_rows(histories)),
    ):
        table = Table(title=title)
        for i, column in enumerate(header):
            table.add_column(column, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    for history in histories:  # a fork's first iterations are its parent's; what it changed tells them apart
        if history.fork is not None:
            console.print(
                f"{history.name}: fork of {history.fork['parent']} at iteration {history.fork['iteration']} "
                f"({describe_changes(history.fork)}); its curves are dashed in the plot"
            )
    console.print(f"plot: {write_plot(histories, plot)}")
