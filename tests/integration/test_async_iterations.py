"""`pipeline.max_staleness: 1`: iteration n+1's rollout and teacher prefill run while iteration n
trains (in the flow's worker process), sampling from (and scored by the teacher of) checkpoint n-1,
recorded in the manifests; a run killed anywhere in the overlap resumes and ends bit-identical to an
uninterrupted one."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.runs import TINY, differences, fingerprint, write_config
from tests.integration.test_crash_resume import crash_and_resume, leftovers, run_env, sdpo

NAME = "async"
ITERATIONS = 3
CONFIG = {
    **TINY,
    "iterations": ITERATIONS,
    "pipeline": {"max_staleness": 1},
    "teacher": {"update": "ema"},
    "eval": {"every": 0, "sampled_n": 2},
}
# Each point is reached whatever the attempt before it left done: the first falls in iteration 3's
# prefetched rollout (it runs while iteration 2 trains, so the kill also cuts that training), then
# iteration 3's teacher, training and commit in the resumed process.
CHAIN = [
    "stage.files_written:rollout@3",
    "stage.committed:teacher@3",
    "checkpoint.uploading:teacher@3",
    "commit.latest_moved@3",
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, prefect_server: str) -> tuple[Path, dict]:
    from storage.layout import RunLayout

    tmp = tmp_path_factory.mktemp("async")
    config = write_config(tmp, NAME, base=CONFIG)
    done = sdpo(["run", str(config)], run_env(prefect_server))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    layout = RunLayout(str(tmp / "runs"), NAME)
    return tmp, fingerprint(layout)


def test_each_iteration_samples_from_and_is_scored_by_checkpoint_n_minus_2(reference):
    from storage.layout import RunLayout
    from storage.manifest import read_stage_manifest

    tmp, _ = reference
    layout = RunLayout(str(tmp / "runs"), NAME)
    for n, behaviour in ((1, 0), (2, 0), (3, 1)):
        rollout = read_stage_manifest(layout, n, "rollout").data
        assert rollout["metrics"]["rollout/behaviour_iteration"] == behaviour
        assert rollout["metrics"]["rollout/staleness"] == n - 1 - behaviour
        assert [p["path"] for p in rollout["parents"]] == [f"checkpoints/iter-{behaviour}/policy/_manifest.json"]
        teacher = read_stage_manifest(layout, n, "teacher").data
        source = "checkpoints/iter-0/policy" if behaviour == 0 else f"checkpoints/iter-{behaviour}/teacher"
        assert [p["path"] for p in teacher["parents"]] == [
            f"iter-{n}/rollout/_manifest.json",
            f"{source}/_manifest.json",
        ]
        assert teacher["metrics"]["teacher/source_iteration"] == behaviour


def test_the_next_rollout_and_teacher_run_in_the_prefetch_worker(reference):
    """Iterations 2 and 3 had their rollout and teacher prefill run by the `prefetch` task (in the
    flow's worker process, submitted before the previous iteration trained), and completed there;
    iteration 1 (nothing before it to overlap) ran them in the flow's own stage tasks. Timings on a
    loaded 2-core machine are no evidence either way, so the Prefect API's task runs are."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    names = [f"{NAME}/iter-{n:04d}/prefetch" for n in (1, 2, 3)]
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=names)))
    completed = {r.name for r in runs if r.state is not None and r.state.is_completed()}
    assert completed == set(names[1:]), sorted(completed)


def test_killed_inside_the_overlap_resumes_bit_identical(tmp_path, prefect_server, reference):
    from storage.layout import RunLayout

    _, expected = reference
    config = write_config(tmp_path, NAME, base=CONFIG)
    crash_and_resume(config, run_env(prefect_server), CHAIN)
    resumed = fingerprint(RunLayout(str(tmp_path / "runs"), NAME))
    assert differences(expected, resumed) == []
    assert resumed["final_policy"] == expected["final_policy"]
    assert leftovers(tmp_path / "runs", tmp_path / "cache") == []


# Two iterations of staleness with the off-policy stabilisers on: the blend's GRPO term with the
# dual clip and advantages clipped at 3x their running mean (whose sums the store carries).
STALE_2 = {
    **CONFIG,
    "iterations": 4,
    "pipeline": {"max_staleness": 2},
    "loss": {"type": "blend", "blend_lambda": 0.9, "ratio_cap": 3.0, "advantage_clip": 3.0},
}
STALE_2_CHAIN = ["stage.files_written:rollout@4", "stage.committed:teacher@4", "commit.latest_moved@4"]


def test_two_iterations_of_staleness_resume_bit_identical_and_log_what_staleness_does(tmp_path, prefect_server):
    """Iteration n samples from checkpoint n-3; killed in iteration 4's prefetched rollout (while
    iteration 2 trains), at its teacher commit and after its LATEST, the run ends bit-identical to an
    uninterrupted one, and MLflow holds per iteration the staleness, the importance weights and
    how much of them, the ratios and the advantages were clipped."""
    from mlflow.tracking import MlflowClient

    from storage.layout import RunLayout
    from storage.manifest import read_stage_manifest

    reference = write_config(tmp_path / "reference", NAME, base=STALE_2)
    done = sdpo(["run", str(reference)], run_env(prefect_server))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    expected = fingerprint(RunLayout(str(tmp_path / "reference" / "runs"), NAME))
    config = write_config(tmp_path / "killed", NAME, base=STALE_2)
    crash_and_resume(config, run_env(prefect_server), STALE_2_CHAIN)
    layout = RunLayout(str(tmp_path / "killed" / "runs"), NAME)
    assert differences(expected, fingerprint(layout)) == []
    assert read_stage_manifest(layout, 4, "rollout").data["metrics"]["rollout/behaviour_iteration"] == 1

    client = MlflowClient(f"sqlite:///{tmp_path / 'killed' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("sdpo").experiment_id])
    for key in (
        "rollout/staleness",
        "sdpo/is_weight_mean",
        "sdpo/is_clip_fraction",
        "grpo/ratio_cap_fraction",
        "grpo/advantage_running_mean",
        "grpo/advantage_clip_fraction",
    ):
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
        assert steps == [1, 2, 3, 4], (key, steps)
    staleness = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "rollout/staleness")}
    assert staleness == {1: 0.0, 2: 1.0, 3: 2.0, 4: 2.0}
