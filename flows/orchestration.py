"""What the flows tell Prefect about themselves: run names, final states, schedules, their logs,
quiet libraries.

Outside a deployment (the CLI, a test calling a flow) there is no deployment to pause; inside one,
`prefect.runtime` names the deployment and the flow run.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shlex
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ParamSpec, TypeVar

logger = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")


def iteration_run_name(run: str, iteration: int) -> str:
    """The flow-run name of iteration `iteration` of SDPO run `run`: `demo/iter-0007`."""
    return f"{run}/iter-{iteration:04d}"


def name_flow_run(name: str) -> None:
    """Rename the current flow run (a flow learns its run and iteration only once it reads the config)."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    if flow_run.id is None:
        return
    with get_client(sync_client=True) as client:
        client.set_flow_run_name(flow_run.id, name)


def skipped_run_name(run: str) -> str:
    """The flow-run name of a flow run that found run `run` finished: `demo/skipped`."""
    return f"{run}/skipped"


# the message of the Cancelled state Prefect's server (3.9.1) gives a flow run that found its
# deployment's concurrency slot taken under the CANCEL_NEW strategy
OVERLAP_MESSAGE = "Deployment concurrency limit reached."


def overlapped_run_name(run: str) -> str:
    """The flow-run name of a tick of run `run` that Prefect cancelled because another tick of its
    deployment was running (CANCEL_NEW): `demo/overlapped`."""
    return f"{run}/overlapped"


def stood_aside_run_name(run: str) -> str:
    """The flow-run name of a flow run that stood aside because another live writer held run `run`."""
    return f"{run}/stood-aside"


def name_overlapped_ticks(run: str) -> list[Any]:
    """Give this deployment's flow runs that Prefect cancelled before they started (an overlapping
    tick under CANCEL_NEW: no code of ours ran, so they kept Prefect's generated names) the name of
    the run they were for, `overlapped_run_name`: those with this flow run's parameters, still
    under a generated name (no `/`) and cancelled for the concurrency limit (`OVERLAP_MESSAGE`; a
    run someone cancelled is left as it is). Returns them; nothing outside a deployment."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.runtime import deployment, flow_run

    if deployment.id is None:
        return []
    ours = flow_run.parameters
    cancelled_runs = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.CANCELLED])))
    with get_client(sync_client=True) as client:
        found = client.read_flow_runs(
            flow_run_filter=cancelled_runs,
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])),
        )
        named = [
            r
            for r in found
            if "/" not in r.name and r.parameters == ours and r.state is not None and r.state.message == OVERLAP_MESSAGE
        ]
        for tick in named:
            client.set_flow_run_name(tick.id, overlapped_run_name(run))
    return named


def set_schedules_active(client: Any, deployment_id: Any, schedules: list[Any], *, active: bool) -> list[Any]:
    """Pause (active=False) or resume each of `schedules` whose state differs; returns those changed.

    Each update sends the schedule's parameters back: Prefect's server (3.9.1) writes an update's
    `parameters` over the schedule's, an empty dict when the update names none, so an update of
    `active` alone (what `prefect deployment schedule pause/resume` and the schedule's toggle in
    Prefect's UI send) clears them, and the schedule's ticks then run the deployment's default
    parameters: another run.
    """
    changed = [s for s in schedules if s.active != active]
    for schedule in changed:
        client.update_deployment_schedule(deployment_id, schedule.id, active=active, parameters=schedule.parameters)
    return changed


def pause_own_schedules(reason: str) -> str | None:
    """Deactivate every active schedule of the deployment this flow run came from, keeping each
    schedule's parameters; returns what was paused and how to resume it, None when nothing was.

    The scheduled path stops itself this way once its run is complete, instead of firing no-op
    runs forever. `sdpo resume-schedule FLOW/DEPLOYMENT` resumes it with its parameters.
    """
    from prefect.client.orchestration import get_client
    from prefect.runtime import deployment, flow_run

    if deployment.id is None:
        return None
    with get_client(sync_client=True) as client:
        schedules = client.read_deployment_schedules(deployment.id)
        paused = set_schedules_active(client, deployment.id, schedules, active=False)
    if not paused:
        return None
    name = f"{flow_run.flow_name}/{deployment.name}"
    logger.warning("paused %d schedule(s) of deployment %s: %s", len(paused), name, reason)
    return (
        f"paused {len(paused)} schedule(s) of deployment {name}, their parameters kept; "
        f"`sdpo resume-schedule {name}` resumes them"
    )


class ScheduleNotResumed(ValueError):
    """Schedules that would have no parameters of their own (resumed, their ticks would run the
    deployment's default parameters: another run than the one they advanced), or parameters given
    that the deployment does not take."""


def resume_schedules(deployment_name: str, given: Mapping[str, Any]) -> tuple[Any, list[Any]]:
    """Resume every paused schedule of deployment `deployment_name` (`FLOW/DEPLOYMENT`) with its
    own parameters updated by `given`; returns the deployment and the schedules resumed (with the
    parameters they now have). ScheduleNotResumed, resuming none, when one of them would
    have no parameters of its own, saying what to pass (the parameters its last tick ran with), or
    when `given` names a parameter the deployment does not take."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        found = client.read_deployment_by_name(deployment_name)
        assert found.parameter_openapi_schema is not None  # the server fills it for every deployment
        takes = found.parameter_openapi_schema["properties"]
        if unknown := sorted(set(given) - set(takes)):
            raise ScheduleNotResumed(
                f"--param {', '.join(unknown)}: not parameters of {deployment_name}, which takes {', '.join(takes)}"
            )
        paused = [s for s in client.read_deployment_schedules(found.id) if not s.active]
        restored = [s.model_copy(update={"parameters": {**s.parameters, **given}}) for s in paused]
        bare = [s for s in restored if not s.parameters]
        if bare:
            raise ScheduleNotResumed(
                "\n".join(_how_to_restore(client, found, deployment_name, schedule) for schedule in bare)
            )
        return found, set_schedules_active(client, found.id, restored, active=True)


def _how_to_restore(client: Any, deployment: Any, name: str, schedule: Any) -> str:
    """Why `schedule` is not resumed, and the command that restores its parameters: those its last
    tick ran with beyond the deployment's own (Prefect keys a tick by `scheduled <deployment>
    <schedule> <time>`)."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.client.schemas.sorting import FlowRunSort

    ticks = client.read_flow_runs(
        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])),
        sort=FlowRunSort.EXPECTED_START_TIME_DESC,
        limit=200,
    )
    key = f"scheduled {deployment.id} {schedule.id} "

    def beyond_defaults(params: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in params.items() if deployment.parameters.get(k) != v}

    own = next(
        (
            beyond_defaults(tick.parameters)
            for tick in ticks
            if tick.idempotency_key is not None
            and tick.idempotency_key.startswith(key)
            and beyond_defaults(tick.parameters)
        ),
        None,
    )
    defaults = ", ".join(f"{k}={v!r}" for k, v in sorted(deployment.parameters.items()))
    said = (
        f"{name}: schedule {schedule.id} has no parameters of its own (Prefect's schedule toggle and "
        f"`prefect deployment schedule resume` clear them), so its ticks would run the deployment's "
        f"defaults ({defaults}), another run; not resumed. "
    )
    if own is None:
        return (
            said
            + f"Pass the parameters of the run it advances: `sdpo resume-schedule {name} --param config_path=CONFIG`"
        )
    params = " ".join(
        "--param " + shlex.quote(f"{k}={v if isinstance(v, str) else json.dumps(v)}") for k, v in sorted(own.items())
    )
    return said + f"Its last tick ran with {own}; restore them: `sdpo resume-schedule {name} {params}`"


def skipped(message: str):
    """A final state for a flow run that had nothing to do: Completed, its message starting with
    "Skipped:". Prefect's own state name is kept: the run lists of Prefect's UI filter by state
    name, and their default ("All except scheduled") leaves out a state of any other name."""
    from prefect.states import Completed

    return Completed(message=f"Skipped: {message}")


def cancelled(message: str):
    """A final state for a flow run that stood aside (another writer holds the run): Cancelled, with the reason."""
    from prefect.states import Cancelled

    return Cancelled(message=message)


OWN_LOGGERS = ("flows", "tasks", "storage", "sdpo_core")


class _ToFlowRun(logging.Filter):
    """Names the flow run on records that carry none (those of threads outside Prefect's context)."""

    def __init__(self, flow_run_id: str) -> None:
        super().__init__()
        self.flow_run_id = flow_run_id

    def filter(self, record: logging.LogRecord) -> bool:
        record.__dict__.setdefault("flow_run_id", self.flow_run_id)
        return True


@contextlib.contextmanager
def logs_in_flow_run() -> Iterator[None]:
    """Send the product's log records (the per-iteration status lines, warnings) to the current
    flow run's logs in Prefect, at the levels its loggers pass, while the block runs: a run started
    from the CLI against a server shows them there as a deployment's does. Prefect's own API handler
    is used; a logger that has one already (PREFECT_LOGGING_EXTRA_LOGGERS) is left as it is. Nothing
    outside a flow run."""
    from prefect.logging.handlers import APILogHandler
    from prefect.runtime import flow_run

    if flow_run.id is None:
        yield
        return
    handler = APILogHandler()
    handler.addFilter(_ToFlowRun(flow_run.id))
    loggers = [logging.getLogger(name) for name in OWN_LOGGERS]
    added = [lg for lg in loggers if not any(isinstance(h, APILogHandler) for h in lg.handlers)]
    for lg in added:
        lg.addHandler(handler)
    try:
        yield
    finally:
        for lg in added:
            lg.removeHandler(handler)


def logs_to_flow_run(body: Callable[P, R]) -> Callable[P, R]:
    """A flow's body run under `logs_in_flow_run` (put it beneath `@flow`)."""

    @functools.wraps(body)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with logs_in_flow_run():
            return body(*args, **kwargs)

    return run


NOISY_LOGGERS = ("httpx", "alembic", "mlflow", "urllib3", "botocore", "werkzeug", "filelock", "torch.distributed")
# Lines that say nothing to act on, dropped by message from the loggers that write them:
DROPPED_LINES = {
    # Prefect's note that its log and event queues are still being sent as the process ends
    "EventsWorker": ("Still processing items",),
    "APILogWorker": ("Still processing items",),
    # MLflow asks the hub for the card and license of the policy it logs, which is a local
    # checkpoint of the run (its name is a folder), so the look-ups can only fail
    "mlflow.transformers": ("The model card could not be retrieved", "Unable to find license information"),
}


class _DropLines(logging.Filter):
    """Drops a logger's records whose message starts with one of `prefixes`."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


def quiet_libraries() -> None:
    """Keep libraries' chatter out of the run's output (download and weight-loading progress bars,
    megatron-core's import-time notes on optional GPU libraries, request logs, MLflow's INFO lines
    such as the system-metrics monitor's, torch's deprecation of the ShardedTensor Megatron's
    checkpoints load through, the lines of `DROPPED_LINES`) and let the flows' own status lines
    through (INFO, unless logging was configured for `flows` already).

    MLflow sets its loggers' level from MLFLOW_LOGGING_LEVEL when it is imported, which may come
    after this call (a worker's flow run imports it when it opens the tracker): the variable is set
    too."""
    from transformers.utils import logging as hf_logging

    own = logging.getLogger("flows")
    if own.level == logging.NOTSET:
        own.setLevel(logging.INFO)
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for name, prefixes in DROPPED_LINES.items():
        target = logging.getLogger(name)
        if not any(isinstance(f, _DropLines) for f in target.filters):
            target.addFilter(_DropLines(prefixes))
    hf_logging.disable_progress_bar()  # per-checkpoint "Loading weights" bars, many per iteration
    hf_logging.set_verbosity_error()
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    warnings.filterwarnings("ignore", module=r"megatron\..*")
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*")
    warnings.filterwarnings("ignore", message=r"Please use DTensor instead", category=FutureWarning)
