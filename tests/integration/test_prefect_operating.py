"""Operating the deployments of infra/prefect/prefect.yaml as the docs say, on a real `prefect server`
with process workers.

- A scheduled `sdpo-advance` deployment whose run is finished pauses its schedule and keeps the
  schedule's parameters; `sdpo resume-schedule` resumes it on the same run, never the deployment's
  default one; a schedule whose parameters Prefect's toggle cleared is refused, naming the parameter
  that restores it. The skipping tick is Completed under Prefect's own state name, which the UI's
  default run filter shows; no library chatter reaches the worker's log. The worker alone names the checkout (SDPO_REPO_DIR, unset where `prefect deploy`
  ran) and the schedule's relative `config_path` resolves against it.
- SDPO_REPO_DIR is read on the worker: the deploying machine's path does not travel with the
  deployment, and a worker without it ends the flow run with an error naming the variable, the flow
  run named after its config.
- A second `sdpo-run` request queued behind the one that finishes the run ends Completed as
  `<run>/skipped` and publishes no second summary; a run another live writer holds ends Cancelled.
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.integration.prefect_server import REPO, Prefect, final_state, flow_runs, run_id_of, wait_for
from tests.integration.runs import write_config

ADVANCE = "sdpo-advance/advance-demo"
PREFECT_YAML = "infra/prefect/prefect.yaml"
WORKER = ["worker", "start", "--pool", "cpu-pool", "--type", "process"]


def sdpo_cli(prefect: Prefect, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=REPO,
        env=prefect.env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_finished_schedule_pauses_with_its_parameters_and_resumes_on_the_same_run(
    tmp_path: Path, prefect: Prefect
) -> None:
    from prefect.client.schemas.schedules import IntervalSchedule

    from storage.layout import RunLayout
    from storage.manifest import read_latest

    checkout = tmp_path / "checkout"  # the worker's SDPO_REPO_DIR, holding the config the schedule names
    write_config(
        checkout / "configs",
        "sched",
        root="runs",
        iterations=1,
        eval={"enabled": False, "every": 0},
        tracking={"log_model": True, "system_metrics": True},
    )
    params = {"config_path": "configs/sched.yaml"}
    worker_log = tmp_path / "worker.log"
    logs = [worker_log, tmp_path / "server.log"]

    prefect.cli("work-pool", "create", "cpu-pool", "--type", "process")
    prefect.cli("deploy", "--name", ADVANCE, "--prefect-file", PREFECT_YAML, unset=["SDPO_REPO_DIR"])
    client = prefect.client()
    deployment = client.read_deployment_by_name(ADVANCE)
    assert deployment.parameters["config_path"] == "configs/demo.yaml"  # the default run, not this one
    (schedule,) = client.read_deployment_schedules(deployment.id)
    interval = IntervalSchedule(interval=dt.timedelta(seconds=10))
    client.update_deployment_schedule(deployment.id, schedule.id, active=True, schedule=interval, parameters=params)
    prefect.start(WORKER, worker_log, cwd=tmp_path, SDPO_REPO_DIR=str(checkout))

    # the run's one iteration, then a tick that finds the run finished and pauses the schedule
    def schedules() -> list[Any]:
        return client.read_deployment_schedules(deployment.id)

    wait_for("the schedule to pause itself", lambda: not schedules()[0].active, timeout=600, logs=logs, interval=3)
    assert schedules()[0].parameters == params  # kept: the schedule still names its run
    assert read_latest(RunLayout(str(checkout / "runs"), "sched")) == 1  # relative to the worker's checkout

    def skipped_after(moment: dt.datetime) -> Any:
        runs = flow_runs(client, deployment.id)
        ended = next(
            (r for r in runs if r.name == "sched/skipped" and r.created > moment and final_state(client, r.id)), None
        )
        return None if ended is None else client.read_flow_run(ended.id)  # as it ended, not as it was listed

    skip = wait_for("the skipping tick to end", lambda: skipped_after(dt.datetime.min.replace(tzinfo=dt.UTC)),
                    timeout=120, logs=logs)  # fmt: skip
    # Prefect's UI filters its run lists by state name, by default every one of its own but
    # Scheduled: a state of another name ("Skipped") would be left out of the deployment's page
    assert skip.state.type.value == "COMPLETED" and skip.state.name == "Completed", skip.state
    assert skip.state.message.startswith("Skipped: run sched is complete (1 iterations")
    assert f"paused 1 schedule(s) of deployment {ADVANCE}, their parameters kept" in skip.state.message
    assert f"sdpo resume-schedule {ADVANCE}" in skip.state.message

    # the schedule's toggle in Prefect's UI sends `active` alone, which clears its parameters:
    # `sdpo resume-schedule` then refuses it, naming the parameter its last tick ran with
    client.update_deployment_schedule(deployment.id, schedule.id, active=False)
    assert schedules()[0].parameters == {}
    refused = sdpo_cli(prefect, "resume-schedule", ADVANCE)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    said = " ".join(refused.stderr.split())
    assert f"schedule {schedule.id} has no parameters of its own" in said and "not resumed" in said, said
    assert f"sdpo resume-schedule {ADVANCE} --param config_path=configs/sched.yaml" in said, said
    assert not schedules()[0].active

    # resumed as the docs say: the schedule carries its parameters, and its next tick is this run's
    resumed_at = dt.datetime.now(dt.UTC)
    done = sdpo_cli(prefect, "resume-schedule", ADVANCE, "--param", "config_path=configs/sched.yaml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "config_path='configs/sched.yaml'" in done.stdout, done.stdout
    assert schedules()[0].active or skipped_after(resumed_at)  # (a fast tick may have paused it again)
    tick = wait_for("a tick after the resume", lambda: skipped_after(resumed_at), timeout=300, logs=logs)
    assert tick.parameters["config_path"] == "configs/sched.yaml" and tick.state.is_completed()
    wait_for("the schedule to pause itself again", lambda: not schedules()[0].active, timeout=60, logs=logs)
    assert schedules()[0].parameters == params
    # no tick of this deployment ran its default run
    assert {r.parameters.get("config_path") for r in flow_runs(client, deployment.id)} == {"configs/sched.yaml"}
    assert read_latest(RunLayout(str(checkout / "runs"), "sched")) == 1
    assert sorted(p.name for p in (checkout / "runs").iterdir()) == ["sched"]

    # the ticks Prefect cancelled because another was running (CANCEL_NEW) are named for their run
    def unnamed() -> list[Any]:
        ended = [r for r in flow_runs(client, deployment.id) if r.state is not None and r.state.is_final()]
        return [(r.name, r.state.message) for r in ended if "/" not in r.name]

    wait_for("every tick to carry its run's name", lambda: not unnamed(), timeout=60, logs=logs)
    # the flow runs' output in the worker's log carries no library chatter
    chatter = ("system metrics", "model card", "license information", "ShardedTensor", "FutureWarning")
    assert [c for c in chatter if c in worker_log.read_text()] == [], worker_log.read_text()[-5000:]


def test_the_checkout_is_read_on_the_worker_and_named_when_it_is_missing(tmp_path: Path, prefect: Prefect) -> None:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    worker_log = tmp_path / "worker.log"
    prefect.cli("work-pool", "create", "cpu-pool", "--type", "process")
    # deployed from a machine whose checkout is somewhere else: that path stays there
    deploying = tmp_path / "deploying-machine" / "sdpo-pipeline"
    prefect.cli("deploy", "--name", ADVANCE, "--prefect-file", PREFECT_YAML, SDPO_REPO_DIR=str(deploying))
    client = prefect.client()
    deployment = client.read_deployment_by_name(ADVANCE)
    assert str(deploying) not in json.dumps(deployment.pull_steps), deployment.pull_steps

    # a worker whose environment lacks it: the flow run ends at its first step, saying what to set
    prefect.start(WORKER, worker_log, cwd=tmp_path, unset=["SDPO_REPO_DIR"])
    flow_run_id = run_id_of(prefect.cli("deployment", "run", ADVANCE))
    state = wait_for("the flow run to end", lambda: final_state(client, flow_run_id), timeout=300, logs=[worker_log])
    # on the flow run itself, where an operator looks: its state, its name (its config's, as the
    # config cannot be read without the checkout) and its logs
    assert state.is_failed(), state
    assert client.read_flow_run(flow_run_id).name == "demo/no-checkout"
    logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    for said in (state.message, "\n".join(log.message for log in logs)):
        assert "SDPO_REPO_DIR is not set where this flow run started" in said, said
        assert "absolute path of the pipeline checkout" in said
    assert "cannot be read" not in worker_log.read_text()  # it stopped before reading a config


def test_a_request_queued_behind_the_one_that_finishes_the_run_is_skipped_and_publishes_nothing(
    tmp_path: Path, prefect: Prefect
) -> None:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from storage.layout import RunLayout

    config = write_config(tmp_path, "queued", iterations=1, eval={"enabled": False, "every": 0})
    worker_log = tmp_path / "worker.log"
    prefect.cli("work-pool", "create", "cpu-pool", "--type", "process")
    prefect.cli("deploy", "--name", "sdpo-run/demo", "--prefect-file", PREFECT_YAML)
    client = prefect.client()
    assert client.read_deployment_by_name("sdpo-run/demo").concurrency_options.collision_strategy.value == "ENQUEUE"
    prefect.start(WORKER, worker_log)
    ids = [
        run_id_of(prefect.cli("deployment", "run", "sdpo-run/demo", "--param", f"config_path={config}"))
        for _ in range(2)
    ]
    for i in ids:
        wait_for(f"flow run {i} to end", lambda i=i: final_state(client, i), timeout=600, logs=[worker_log])
    runs = sorted((client.read_flow_run(i) for i in ids), key=lambda r: r.name)
    assert [r.name for r in runs] == ["queued/run-to-0001", "queued/skipped"], [(r.name, r.state) for r in runs]
    trained, skipped = runs
    assert trained.state.is_completed() and trained.state.name == "Completed"
    assert skipped.state.is_completed() and skipped.state.name == "Completed", skipped.state
    assert skipped.state.message.startswith("Skipped: run queued is complete (1 iterations"), skipped.state.message
    summaries = client.read_artifacts(
        artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["sdpo-queued-summary"]))
    )
    assert len(summaries) == 1, [a.created for a in summaries]
    assert summaries[0].flow_run_id == trained.id
    from storage.summary import read_run_summary

    record = read_run_summary(RunLayout(str(tmp_path / "runs"), "queued"))
    assert record is not None and record["last_iteration"] == 1


def test_a_run_another_live_writer_holds_is_cancelled_naming_it(tmp_path: Path, prefect_server: str) -> None:
    from flows.run import sdpo_run
    from storage.lock import RunLock
    from storage.manifest import read_latest
    from tasks.config import load_config
    from tasks.runtime import run_layout

    config = write_config(tmp_path, "held", iterations=1)
    layout = run_layout(load_config(config))
    with RunLock(layout, lease_seconds=60, heartbeat_seconds=15):
        state = sdpo_run(str(config), [], return_state=True)
    assert state.is_cancelled(), state
    assert "run held is being written by" in state.message and "stands aside" in state.message
    assert read_latest(layout) is None
