"""The deployments of infra/prefect/prefect.yaml on a real `prefect server` with process workers.

The first scenario, end to end, as an operator runs it: deploy every deployment and the automations,
start a worker, `prefect deployment run` the scheduled `sdpo-advance` deployment twice at once (one
run commits iteration 1, the overlapping one ends Cancelled), turn its schedule on, kill the worker
and the flow run's process in the middle of iteration 2, start a new worker, and wait: the dead
run is marked Crashed when its heartbeats stop, the next ticks resume and finish the SDPO run, the
tick after that ends Completed as `sched/skipped` and pauses the schedule. No flow run ends Failed, MLflow has every
step exactly once, each iteration left its Prefect artifacts and its status line in Prefect's logs.

The second: a run whose train stage is a flow run of `sdpo-stage/cpu` loses that stage's worker with
its processes, as when its machine goes; the run's own process lives on. The automation marks the
stage's flow run Crashed when its heartbeats stop, the stage's task starts it again as a new flow
run, a second worker takes it, and the run finishes by itself.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from tests.integration.prefect_server import Prefect, flow_runs, kill_group, run_id_of, wait_for
from tests.integration.runs import write_config

DEPLOYMENT = "sdpo-advance/advance-demo"
ITERATIONS = 3


def test_scheduled_deployment_recovers_from_a_killed_worker_and_stops_when_done(
    tmp_path: Path, prefect: Prefect
) -> None:
    from mlflow.tracking import MlflowClient
    from prefect.client.schemas.schedules import IntervalSchedule

    from storage.layout import RunLayout
    from storage.lock import read_lock_holder
    from storage.manifest import read_latest, stage_done

    config = write_config(tmp_path, "sched", iterations=ITERATIONS, eval={"every": 0})
    layout = RunLayout(str(tmp_path / "runs"), "sched")
    worker_log, second_worker_log = tmp_path / "worker.log", tmp_path / "worker2.log"
    logs = [worker_log, second_worker_log, tmp_path / "server.log"]

    prefect.cli("work-pool", "create", "cpu-pool", "--type", "process")
    prefect.cli("work-pool", "create", "gpu-pool", "--type", "process")
    deployed = prefect.cli("deploy", "--all", "--prefect-file", "infra/prefect/prefect.yaml")
    for name in (
        "sdpo-run/demo",
        "sdpo-run/demo-grpo",
        DEPLOYMENT,
        "sdpo-run/gpu-run",
        "sdpo-eval/eval",
        "sdpo-test-time/test-time-arith",
    ):
        assert name in deployed, deployed
    prefect.cli("automation", "create", "--from-file", "infra/prefect/automations.yaml")
    client = prefect.client()
    deployment = client.read_deployment_by_name(DEPLOYMENT)
    assert deployment.global_concurrency_limit.limit == 1
    assert deployment.concurrency_options.collision_strategy.value == "CANCEL_NEW"
    params = deployment.parameter_openapi_schema["properties"]
    assert {"config_path", "overrides", "allow_config_change", "force_unlock"} <= set(params)
    assert params["force_unlock"]["type"] == "boolean" and "heartbeat" in params["force_unlock"]["description"]
    worker = prefect.start(["worker", "start", "--pool", "cpu-pool", "--type", "process"], worker_log)

    # two runs at once: one commits iteration 1, the overlapping one is Cancelled, not Failed
    param = f"config_path={config}"
    first = run_id_of(prefect.cli("deployment", "run", DEPLOYMENT, "--param", param))
    second = run_id_of(prefect.cli("deployment", "run", DEPLOYMENT, "--param", param))
    final = lambda i: (s := client.read_flow_run(i).state) is not None and s.is_final() and s  # noqa: E731
    states = [wait_for(f"flow run {i} to end", lambda i=i: final(i), timeout=400, logs=logs) for i in (first, second)]
    assert sorted(s.type.value for s in states) == ["CANCELLED", "COMPLETED"], [(s.type, s.message) for s in states]
    assert read_latest(layout) == 1
    done, overlapped = (first, second) if states[0].is_completed() else (second, first)
    assert client.read_flow_run(done).name == "sched/iter-0001"
    assert client.read_flow_run(overlapped).name == "sched/overlapped"  # not Prefect's generated name

    # the schedule on; kill the worker and the flow run's process in the middle of iteration 2
    (schedule,) = client.read_deployment_schedules(deployment.id)
    client.update_deployment_schedule(
        deployment.id,
        schedule.id,
        active=True,
        schedule=IntervalSchedule(interval=dt.timedelta(seconds=10)),
        parameters={"config_path": str(config)},
    )
    wait_for("iteration 2's rollout", lambda: stage_done(layout, 2, "rollout"), timeout=300, logs=logs, interval=0.2)
    holder = read_lock_holder(layout)
    assert holder is not None
    kill_group(worker)
    os.kill(holder.pid, signal.SIGKILL)
    zombie = next(r for r in flow_runs(client, deployment.id) if r.state.is_running())
    prefect.start(["worker", "start", "--pool", "cpu-pool", "--type", "process"], second_worker_log)

    # by itself: the dead run becomes Crashed, the next ticks finish the run, one more skips and pauses
    def skipped() -> Any:
        return next(
            (r for r in flow_runs(client, deployment.id) if r.name == "sched/skipped" and r.state.is_final()), None
        )

    skip = wait_for("a Skipped tick", skipped, timeout=480, logs=logs, interval=3)
    assert skip.state.is_completed() and skip.state.message.startswith("Skipped: run sched is complete")
    assert "paused 1 schedule" in skip.state.message
    assert [s.active for s in client.read_deployment_schedules(deployment.id)] == [False]
    assert client.read_flow_run(zombie.id).state.is_crashed()
    assert read_latest(layout) == ITERATIONS and read_lock_holder(layout) is None
    runs = flow_runs(client, deployment.id)
    assert not [r.name for r in runs if r.state.is_failed()]
    names = {r.name for r in runs if r.state.is_completed()}
    assert {"sched/iter-0001", "sched/iter-0002", "sched/iter-0003", "sched/skipped"} <= names

    # MLflow: every step once, the loss named by its type
    mlflow = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (mlrun,) = mlflow.search_runs([mlflow.get_experiment_by_name("sdpo").experiment_id])
    assert [m.step for m in mlflow.get_metric_history(mlrun.info.run_id, "tracking/step")] == [0, 1, 2, 3]
    assert [m.step for m in mlflow.get_metric_history(mlrun.info.run_id, "loss/sdpo")] == [1, 2, 3]
    assert "loss/total" not in mlrun.data.metrics and mlrun.info.status == "FINISHED"
    tables = {a.path for a in mlflow.list_artifacts(mlrun.info.run_id, "samples")}
    assert tables == {f"samples/iter-{n:04d}.json" for n in (1, 2, 3)}

    # Prefect: artifacts of every iteration and of the run, the status line in the flow run's logs
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, LogFilter, LogFilterFlowRunId

    artifacts = client.read_artifacts(
        artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["sdpo-sched-iteration"]))
    )
    assert {a.description.split(":")[0] for a in artifacts} == {f"sched iteration {n}" for n in (1, 2, 3)}
    assert any("Teacher signal on" in a.data and "mlflow" in a.data.lower() for a in artifacts)
    samples = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["sdpo-sched-samples"])))
    assert len(samples) == 3 and all(a.type == "table" for a in samples)
    assert client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["sdpo-sched-summary"])))
    lines = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[done])))
    assert any("iteration 1/3 | reward" in line.message for line in lines), [line.message for line in lines]


def test_a_stage_whose_worker_is_lost_runs_again_on_another_worker(tmp_path: Path, prefect: Prefect) -> None:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    from storage.layout import RunLayout
    from storage.manifest import read_latest

    config = write_config(
        tmp_path,
        "lost",
        iterations=1,
        eval={"every": 0},
        launch={"train": {"launcher": "work-pool", "deployment": "sdpo-stage/cpu"}},
    )
    first_log, second_log, run_log = tmp_path / "worker.log", tmp_path / "worker2.log", tmp_path / "run.log"
    logs = [run_log, first_log, second_log, tmp_path / "server.log"]
    prefect.cli("work-pool", "create", "cpu-pool", "--type", "process")
    prefect.cli("work-pool", "create", "gpu-pool", "--type", "process")
    deployed = prefect.cli("deploy", "--all", "--prefect-file", "infra/prefect/prefect.yaml")
    assert "sdpo-stage/cpu" in deployed and "sdpo-stage/gpu" in deployed, deployed
    prefect.cli("automation", "create", "--from-file", "infra/prefect/automations.yaml")
    client = prefect.client()
    assert set(client.read_deployment_by_name("sdpo-stage/gpu").tags) == {"sdpo", "stage"}
    # the first worker's stage pauses at its start, as a long stage would be running when its machine goes
    first = prefect.start(["worker", "start", "--pool", "cpu-pool", "--type", "process"], first_log,
                          SDPO_PAUSE_AT="stage.start:train")  # fmt: skip
    with run_log.open("w") as out:
        run = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "run", str(config)],
            cwd=tmp_path,
            env={**prefect.env, "OMP_NUM_THREADS": "1"},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    prefect.processes.append(run)
    named = FlowRunFilter(name=FlowRunFilterName(any_=["lost/iter-0001/train"]))
    stage_runs = lambda: sorted(client.read_flow_runs(flow_run_filter=named), key=lambda r: r.created)  # noqa: E731

    def stage_running() -> bool:
        assert run.poll() is None, run_log.read_text()[-4000:]
        return any(r.state.is_running() for r in stage_runs())

    wait_for("the train stage on the first worker", stage_running, timeout=300, logs=logs, interval=0.5)
    time.sleep(8)  # its first heartbeat sent; the stage paused at its start
    # the machine goes: the worker and every process it started, at once; the run's process lives on
    doomed = psutil.Process(first.pid).children(recursive=True)
    assert doomed, first_log.read_text()[-3000:]
    (lost,) = stage_runs()
    assert lost.state.is_running(), lost.state
    kill_group(first)
    for process in doomed:
        with contextlib.suppress(psutil.NoSuchProcess):  # gone with the worker's process group
            process.kill()
    prefect.start(["worker", "start", "--pool", "cpu-pool", "--type", "process"], second_log)

    assert run.wait(timeout=420) == 0, "\n".join(f"--- {p.name}:\n{p.read_text()[-3000:]}" for p in logs)
    assert read_latest(RunLayout(str(tmp_path / "runs"), "lost")) == 1
    crashed, finished = stage_runs()
    assert crashed.id == lost.id and crashed.state.is_crashed(), crashed.state
    assert "No heartbeat" in crashed.state.message, crashed.state.message
    assert finished.state.is_completed(), finished.state
    assert "Crashed" in run_log.read_text()  # the retry names why the stage ran again
