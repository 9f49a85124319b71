"""What the flows tell Prefect about themselves: run names, final states, schedules, quiet libraries.

Outside a deployment (the CLI, a test calling a flow) there is no deployment to pause; inside one,
`prefect.runtime` names the deployment and the flow run.
"""

from __future__ import annotations

import logging
import os
import warnings

logger = logging.getLogger(__name__)


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


def pause_own_schedules(reason: str) -> list[str]:
    """Deactivate every active schedule of the deployment this flow run came from; returns their ids.

    The scheduled path stops itself this way once its run is complete, instead of firing no-op
    runs forever. Resume with `prefect deployment schedule resume`.
    """
    from prefect.client.orchestration import get_client
    from prefect.runtime import deployment

    if deployment.id is None:
        return []
    paused: list[str] = []
    with get_client(sync_client=True) as client:
        for schedule in client.read_deployment_schedules(deployment.id):
            if schedule.active:
                client.update_deployment_schedule(deployment.id, schedule.id, active=False)
                paused.append(str(schedule.id))
    if paused:
        logger.warning("paused %d schedule(s) of deployment %s: %s", len(paused), deployment.name, reason)
    return paused


def skipped(message: str):
    """A final state for a flow run that had nothing to do: Completed, named "Skipped", with the reason."""
    from prefect.states import Completed

    return Completed(name="Skipped", message=message)


def cancelled(message: str):
    """A final state for a flow run that stood aside (another writer holds the run): Cancelled, with the reason."""
    from prefect.states import Cancelled

    return Cancelled(message=message)


NOISY_LOGGERS = ("httpx", "alembic", "mlflow", "urllib3", "botocore", "werkzeug", "filelock", "torch.distributed")


def quiet_libraries() -> None:
    """Keep libraries' chatter out of the run's output (download and weight-loading progress bars,
    megatron-core's import-time notes on optional GPU libraries, request logs) and let the flows'
    own status lines through (INFO, unless logging was configured for `flows` already)."""
    from transformers.utils import logging as hf_logging

    own = logging.getLogger("flows")
    if own.level == logging.NOTSET:
        own.setLevel(logging.INFO)
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    hf_logging.disable_progress_bar()  # per-checkpoint "Loading weights" bars, many per iteration
    hf_logging.set_verbosity_error()
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    warnings.filterwarnings("ignore", module=r"megatron\..*")
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*")
