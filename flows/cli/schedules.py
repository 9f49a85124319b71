"""`sdpo resume-schedule`: resume the schedules a scheduled deployment paused, with their parameters.

A `sdpo-advance` deployment pauses its own schedules once its run is finished, keeping each
schedule's parameters (the run it advances). Prefect's `prefect deployment schedule resume` and the
schedule's toggle in its UI (3.9.1) send only `active`, which its server takes as "no parameters":
the resumed schedule would advance the deployment's default run instead. This command sends them
back with the update, and refuses a schedule left without parameters of its own (its ticks would
advance the deployment's default run), saying which `--param` restores them.
"""

from __future__ import annotations

import json
import os
from typing import Annotated, Any

import typer

from flows.cli.app import app, fail


def parse_params(pairs: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` pairs as `prefect deployment run --param` reads them: a value that is JSON is
    read as JSON (lists, numbers, booleans), any other is a string. Exit 2 on a pair without `=`."""
    params: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            fail(f"--param {pair!r}: expected KEY=VALUE, e.g. config_path=configs/demo.yaml")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    return params


@app.command("resume-schedule")
def resume_schedule(
    deployment: Annotated[str, typer.Argument(help="FLOW/DEPLOYMENT, e.g. sdpo-advance/advance-demo")],
    param: Annotated[
        list[str] | None,
        typer.Option(
            "--param",
            metavar="KEY=VALUE",
            help="a parameter of the schedules' own, set before they resume (JSON values as with `prefect "
            "deployment run --param`), e.g. config_path=configs/demo.yaml; restores what a toggle cleared",
        ),
    ] = None,
) -> None:
    """Resume the paused schedules of a deployment on the Prefect server (PREFECT_API_URL), each with
    the parameters it had (and those given with --param): its next ticks advance the run it advanced
    before. A schedule left without parameters of its own is not resumed (exit 2): its ticks would
    run the deployment's default run; the message says what to pass."""
    from prefect.exceptions import ObjectNotFound

    from flows.orchestration import ScheduleNotResumed, resume_schedules

    if not os.environ.get("PREFECT_API_URL"):
        fail("PREFECT_API_URL is not set: set it to the Prefect server the deployment is on")
    if deployment.count("/") != 1:
        fail(f"deployment {deployment!r}: expected FLOW/DEPLOYMENT, e.g. sdpo-advance/advance-demo")
    given = parse_params(list(param or []))
    try:
        found, resumed = resume_schedules(deployment, given)
    except ObjectNotFound:
        fail(f"no deployment {deployment!r} on {os.environ['PREFECT_API_URL']}")
    except ScheduleNotResumed as err:
        fail(str(err))
    if not resumed:
        typer.echo(f"{deployment}: no paused schedule, nothing to resume")
        return
    for schedule in resumed:
        given_now = ", ".join(f"{k}={v!r}" for k, v in sorted(schedule.parameters.items()))
        typer.echo(f"{deployment}: resumed schedule {schedule.id} with its parameters {given_now}")
