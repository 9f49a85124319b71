"""Stage launchers: run a stage in the flow's process, in a fresh process, or under torchrun.

Every stage is a function of `(root, run, iteration)` that reads its inputs from the store and
writes its outputs and manifest there (`STAGE_BODIES`). `sdpo stage NAME --root URL --run NAME
--iteration N` is the same function as a process; the launchers below start that process:

- `inprocess`: call the body here (one machine, the default);
- `subprocess`: `python -m flows.cli stage ...` in a fresh process; a crash of the stage cannot take
  the flow down, and the stage's memory is returned to the system when it ends;
- `torchrun`: the same command under `torch.distributed.run` over `nproc_per_node` x `nnodes` ranks
  (training and Megatron teacher scoring, tensor x data parallel); only rank 0 writes manifests;
- `work-pool`: a flow run of a deployment of `flows/stage.py:sdpo_stage` on a Prefect work pool,
  waited for; the pool's worker decides where it runs.

A launched stage that exits non-zero fails with `StageProcessError` carrying the end of its output
(under torchrun, the failing rank's traceback). Nothing is passed back but the exit status: the
flow reads the stage's manifest from the store, so a stage can run anywhere the store is reachable.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

STAGES = ("prepare-base", "rollout", "teacher", "train", "commit", "eval")
OPTIONS_ENV = "SDPO_STORAGE_OPTIONS"  # the store's fsspec options, JSON (an allow-list without credentials)
_TAIL = 6000
# a stage's flow run that no worker of its pool has taken after this long is named in a warning
UNCLAIMED_WARNING_S = 120.0


class StageProcessError(RuntimeError):
    """A stage process (or one of its torchrun ranks) exited non-zero."""


class StageInfrastructureLost(StageProcessError):
    """A stage's flow run on a work pool ended Crashed: its process or its machine went away (a
    worker lost with its machine, which Prefect's heartbeat automation marks Crashed, an evicted pod,
    a process killed by the kernel) rather than the stage raising. Another attempt on a live worker
    of the pool can finish it, so the stage's task retries it (`tasks.stages.retry_transient`)."""


def _prepare_base(root: str, run: str, iteration: int) -> Any:
    from tasks.prepare_base import ensure_base_checkpoint
    from tasks.runtime import open_run

    return ensure_base_checkpoint(open_run(root, run))


def _rollout(root: str, run: str, iteration: int) -> Any:
    from tasks.rollout import run_rollout

    return run_rollout(root, run, iteration)


def _teacher(root: str, run: str, iteration: int) -> Any:
    from tasks.teacher import run_teacher

    return run_teacher(root, run, iteration)


def _train(root: str, run: str, iteration: int) -> Any:
    from tasks.train import run_train

    return run_train(root, run, iteration)


def _commit(root: str, run: str, iteration: int) -> Any:
    from tasks.commit import run_commit

    return run_commit(root, run, iteration)


def _eval(root: str, run: str, iteration: int) -> Any:
    from tasks.evaluate import run_evaluation

    return run_evaluation(root, run, iteration)


STAGE_BODIES: dict[str, Callable[[str, str, int], Any]] = {
    "prepare-base": _prepare_base,
    "rollout": _rollout,
    "teacher": _teacher,
    "train": _train,
    "commit": _commit,
    "eval": _eval,
}


def run_stage(stage: str, root: str, run: str, iteration: int) -> Any:
    """The stage's body in this process: what `sdpo stage` runs. The checkpoints it takes from the
    local cache stay pinned until it returns (another run sharing the cache cannot evict them)."""
    from storage.cache import pinned_cache

    if stage not in STAGE_BODIES:
        raise ValueError(f"unknown stage {stage!r}; stages are {STAGES}")
    with pinned_cache():
        return STAGE_BODIES[stage](root, run, iteration)


def leave_process_group() -> None:
    """End this process's part in torch.distributed, if a stage body joined it (training and
    Megatron scoring do, under torchrun and in a world of one): every rank of a torchrun stage calls
    this once its body returned, before the interpreter exits (`tasks.megatron.parallel`)."""
    distributed = sys.modules.get("torch.distributed")  # a process that never imported it has no group
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        from tasks.megatron.parallel import destroy_parallel

        destroy_parallel()


def stage_command(stage: str, root: str, run: str, iteration: int, spec: Mapping[str, Any]) -> list[str]:
    """The command line that runs the stage as a process under `spec` (a `StageLaunch` as a dict)."""
    # `--run-name`, not `--run`: torchrun's parser would take `--run` for its own `--run-path`
    sdpo = ["-m", "flows.cli", "stage", stage, "--root", root, "--run-name", run, "--iteration", str(iteration)]
    if spec["launcher"] == "subprocess":
        return [sys.executable, *sdpo]
    if spec["launcher"] != "torchrun":
        raise ValueError(f"launcher {spec['launcher']!r} runs no process")
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={spec['nproc_per_node']}"]
    if spec["nnodes"] > 1:
        host, _, port = str(spec["rdzv_endpoint"]).rpartition(":")
        torchrun += [
            f"--nnodes={spec['nnodes']}",
            f"--node_rank={spec['node_rank']}",
            f"--master_addr={host}",
            f"--master_port={port}",
        ]
    elif spec["master_port"] is not None:
        torchrun += ["--nnodes=1", "--master_addr=127.0.0.1", f"--master_port={spec['master_port']}"]
    else:
        torchrun += ["--standalone"]
    return [*torchrun, *sdpo]


def launch_stage(
    stage: str,
    root: str,
    run: str,
    iteration: int,
    spec: Mapping[str, Any],
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> None:
    """Run the stage where `spec` says; raises StageProcessError when its process fails."""
    if spec["launcher"] == "inprocess":
        run_stage(stage, root, run, iteration)
        return
    if spec["launcher"] == "work-pool":
        _run_on_work_pool(stage, root, run, iteration, spec)
        return
    from tasks.lifetime import child_environment

    command = stage_command(stage, root, run, iteration, spec)
    env = {**os.environ, **child_environment()}  # the stage process ends if this one does (tasks.lifetime)
    if storage_options:
        env[OPTIONS_ENV] = json.dumps(dict(storage_options))
    logger.info("launching %s of iteration %d: %s", stage, iteration, " ".join(command))
    # Its own session: a stage that crashes (or is killed with its process group) leaves the flow standing.
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=spec["timeout_s"])
    except subprocess.TimeoutExpired:
        # torchrun's ranks lead groups of their own: each ends within a second of seeing torchrun gone
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise StageProcessError(
            f"stage {stage} of iteration {iteration} of run {run!r} ran past launch.{stage}.timeout_s="
            f"{spec['timeout_s']} and was killed; its last output:\n{output[-_TAIL:]}"
        ) from None
    finally:
        if process.poll() is None:  # interrupted (Ctrl-C): the stage must not run on without its flow
            os.killpg(process.pid, signal.SIGKILL)
    if process.returncode != 0:
        raise StageProcessError(
            f"stage {stage} of iteration {iteration} of run {run!r} failed: {' '.join(command)} exited with "
            f"{process.returncode}; its last output:\n{output[-_TAIL:]}"
        )
    logger.debug("%s of iteration %d finished:\n%s", stage, iteration, output[-_TAIL:])


def _run_on_work_pool(
    stage: str,
    root: str,
    run: str,
    iteration: int,
    spec: Mapping[str, Any],
) -> None:
    """The stage as a flow run of `spec['deployment']` (flows/stage.py), waited for; its failure is
    ours. A flow run of the same stage that an earlier launcher left going (Scheduled, Pending or
    Running: that launcher's machine was lost with its guard) is waited for instead of a new one.
    A guard cancels the flow run should this process die while waiting, and this process cancels it
    when the wait is interrupted (Ctrl-C, SIGTERM): the stage does not run on without its flow
    (tasks.lifetime)."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    from tasks.lifetime import cancel_flow_run, guard_flow_run

    # Prefect stores a flow run's parameters: paths and names only; the pool's jobs take the store's
    # options from their own environment (SDPO_STORAGE_OPTIONS)
    parameters = {"stage": stage, "root": root, "run": run, "iteration": iteration}
    name = f"{run}/iter-{iteration:04d}/{stage}"
    with get_client(sync_client=True) as client:
        # one that a launcher which died without cancelling it (its machine lost with its guard) left going
        left = _unfinished_flow_run(client, spec["deployment"], name, parameters)
    if left is None:
        logger.info("running %s of iteration %d on deployment %s", stage, iteration, spec["deployment"])
        flow_run = run_deployment(spec["deployment"], parameters=parameters, flow_run_name=name, timeout=0)
    else:
        flow_run = left
    where = f"stage {stage} of iteration {iteration} of run {run!r} on deployment {spec['deployment']}"
    who = f"{where}: flow run {name} ({flow_run.id})"
    if left is not None:
        status = left.state.name if left.state else "without a state"
        logger.warning("%s: attaching to it (%s, from an earlier attempt) instead of starting another", who, status)
    guard = guard_flow_run(flow_run.id)
    try:
        started = time.monotonic()
        warned = False
        with get_client(sync_client=True) as client:
            while not (flow_run.state is not None and flow_run.state.is_final()):
                waited = time.monotonic() - started
                if spec["timeout_s"] is not None and waited >= spec["timeout_s"]:
                    break  # stop waiting; the flow run goes on (launch.<stage>.timeout_s)
                if (
                    not warned
                    and waited >= UNCLAIMED_WARNING_S
                    and flow_run.state is not None
                    and flow_run.state.is_scheduled()
                ):
                    pool = flow_run.work_pool_name
                    logger.warning(
                        "%s has waited %.0f s for a worker of work pool %r (%s); is one running? "
                        "prefect worker start --pool %s",
                        *(who, waited, pool, flow_run.state.name, pool),
                    )
                    warned = True
                time.sleep(1)
                flow_run = client.read_flow_run(flow_run.id)
    except BaseException:
        cancel_flow_run(flow_run.id)
        raise
    finally:
        guard.kill()
        guard.wait()
    state = flow_run.state
    if state is not None and state.is_crashed():
        raise StageInfrastructureLost(f"{who} Crashed: {state.message}")
    if state is None or not state.is_final():
        raise StageProcessError(
            f"{who} did not end within launch.{stage}.timeout_s={spec['timeout_s']} (it is "
            f"{state.name if state else 'without a state'}); the wait stopped, the flow run goes on"
        )
    if not state.is_completed():
        raise StageProcessError(f"{who} ended {state.name}: {state.message}")


def _unfinished_flow_run(client: Any, deployment: str, name: str, parameters: Mapping[str, Any]) -> Any | None:
    """The newest flow run of `deployment` named `name` for the same stage of the same run (root,
    run, iteration, stage) that has not ended and is not being cancelled: Scheduled, Pending or
    Running; None when there is none."""
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterName,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    deployment_id = client.read_deployment_by_name(deployment).id
    live = FlowRunFilterStateType(any_=[StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING])
    runs = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name]), state=FlowRunFilterState(type=live)),
        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
        sort=FlowRunSort.EXPECTED_START_TIME_DESC,
    )
    same = ("stage", "root", "run", "iteration")
    return next((r for r in runs if all(r.parameters.get(k) == parameters[k] for k in same)), None)


def register_stage_options(root: str) -> None:
    """In a stage process: register the store options the launcher passed (`SDPO_STORAGE_OPTIONS`),
    checked against the config's allow-list (credentials come from the environment or a profile)."""
    from storage.urls import register_options
    from tasks.config import parse_storage_options

    raw = os.environ.get(OPTIONS_ENV)
    if raw:
        register_options(root, parse_storage_options(raw, source=OPTIONS_ENV))
