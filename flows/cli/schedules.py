"""`sdpo resume-schedule`: resume the schedules a scheduled deployment paused, with their parameters.

A `sdpo-advance` deployment pauses its own schedules once its run is finished, keeping each
schedule's parameters (the run it advances). Prefect's `prefect deployment schedule resume` and the
schedule's toggle in its UI (3.9.1) send only `active`, which its server takes as "no parameters":
the resumed schedule would advance the deployment's default run instead. This command sends them
back with the update.
"""

from __future__ import annotations

import os
from typing import Annotated

import typer

from flows.cli.app import app, fail


@app.command("resume-schedule")
def resume_schedule(
    deployment: Annotated[str, typer.Argument(help="FLOW/DEPLOYMENT, e.g. sdpo-advance/advance-demo")],
) -> None:
    """Resume the paused schedules of a deployment on the Prefect server (PREFECT_API_URL), each with
    the parameters it had: its next ticks advance the run it advanced before."""
    from prefect.exceptions import ObjectNotFound

    from flows.orchestration import resume_schedules

    if not os.environ.get("PREFECT_API_URL"):
        fail("PREFECT_API_URL is not set: set it to the Prefect server the deployment is on")
    if deployment.count("/") != 1:
        fail(f"deployment {deployment!r}: expected FLOW/DEPLOYMENT, e.g. sdpo-advance/advance-demo")
    try:
        found, resumed = resume_schedules(deployment)
    except ObjectNotFound:
        fail(f"no deployment {deployment!r} on {os.environ['PREFECT_API_URL']}")
    if not resumed:
        typer.echo(f"{deployment}: no paused schedule, nothing to resume")
        return
    for schedule in resumed:
        if schedule.parameters:
            given = ", ".join(f"{k}={v!r}" for k, v in sorted(schedule.parameters.items()))
            typer.echo(f"{deployment}: resumed schedule {schedule.id} with its parameters {given}")
        else:
            defaults = ", ".join(f"{k}={v!r}" for k, v in sorted(found.parameters.items()))
            typer.echo(
                f"{deployment}: resumed schedule {schedule.id}; it has no parameters of its own, so its "
                f"ticks run the deployment's: {defaults}"
            )
