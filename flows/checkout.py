"""Where a deployment's flow run starts on a worker: the checkout SDPO_REPO_DIR names there.

`infra/prefect/prefect.yaml` runs `enter_checkout` as its pull step, when each flow run starts, so
the variable is read on the worker. (Prefect fills a `{{ $VAR }}` placeholder of a pull step when
`prefect deploy` runs wherever the variable is set there, which baked the deploying machine's path
into the deployment; where it was set nowhere, the step went on in whatever directory the flow run
started in, and the flow failed later on a config it could not read.)

A flow's `config_path` and the relative `storage.root` of the configs resolve against this
directory. The pipeline images set SDPO_REPO_DIR=/opt/sdpo, where they put the project.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from uuid import UUID

logger = logging.getLogger(__name__)

REPO_DIR_ENV = "SDPO_REPO_DIR"
_HOW = (
    f"set {REPO_DIR_ENV} in the worker's environment (or in its work pool's `env` job variable) to the "
    "absolute path of the pipeline checkout the flows run from, the folder holding configs/ "
    f"(e.g. `export {REPO_DIR_ENV}=$PWD` in the checkout before `prefect worker start`)"
)


def checkout_dir(environ: Mapping[str, str]) -> Path:
    """The checkout SDPO_REPO_DIR names in `environ`; ValueError naming the variable, its value and
    what to set when it is unset, relative, or not a checkout (no configs/ folder)."""
    value = environ.get(REPO_DIR_ENV, "")
    if not value.strip():
        raise ValueError(f"{REPO_DIR_ENV} is not set where this flow run started: {_HOW}")
    path = Path(value).expanduser()
    if not path.is_absolute():
        raise ValueError(f"{REPO_DIR_ENV}={value!r} is a relative path: {_HOW}")
    if not (path / "configs").is_dir():
        raise ValueError(
            f"{REPO_DIR_ENV}={value!r} is not a pipeline checkout ({path / 'configs'} is not a folder): {_HOW}"
        )
    return path


def enter_checkout() -> dict[str, str]:
    """The pull step: make the checkout SDPO_REPO_DIR names the working directory. Returns
    `{"directory": ...}`, as Prefect's `set_working_directory` step does. Without a checkout, the
    flow run is marked Failed with the reason before the step raises."""
    try:
        path = checkout_dir(os.environ)
    except ValueError as err:
        fail_flow_run(str(err))
        raise
    os.chdir(path)
    logger.info("flow run working directory: %s (%s)", path, REPO_DIR_ENV)
    return {"directory": str(path)}


def fail_flow_run(message: str) -> None:
    """Mark the flow run this process prepares (PREFECT__FLOW_RUN_ID) Failed with `message`, also
    one line of its logs. A failed pull step otherwise leaves it "Crashed: Process exited with
    status code: 1", the reason only in the worker's own output; a final state stays as it is when
    the worker then reports the crash. A flow run still under Prefect's generated name is named
    after the config it was given, `<config file's stem>/no-checkout` (without a checkout the config,
    and so the run's own name, cannot be read). Nothing outside a flow run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import LogCreate
    from prefect.states import Failed

    flow_run_id = os.environ.get("PREFECT__FLOW_RUN_ID")
    if not flow_run_id:
        return
    line = LogCreate.model_validate(
        {
            "name": __name__,
            "level": logging.ERROR,
            "message": message,
            "timestamp": datetime.datetime.now(datetime.UTC),
            "flow_run_id": flow_run_id,
        }
    )
    with get_client(sync_client=True) as client:
        client.create_logs([line])
        client.set_flow_run_state(flow_run_id, Failed(message=message), force=True)
        found = client.read_flow_run(UUID(flow_run_id))
        if "/" not in found.name and found.parameters.get("config_path"):
            client.set_flow_run_name(found.id, f"{Path(found.parameters['config_path']).stem}/no-checkout")
