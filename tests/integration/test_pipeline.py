"""The whole pipeline on a minuscule config: flows, shards, Megatron training, commits, MLflow, restart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.integration.runs import write_config

REPO = Path(__file__).resolve().parents[2]


def test_two_iterations_commit_shards_checkpoints_and_metrics(tmp_path, prefect_server, monkeypatch):
    from mlflow.tracking import MlflowClient

    from flows.run import sdpo_run
    from storage.checkpoints import lineage
    from storage.layout import RunLayout
    from storage.manifest import read_iteration_manifest, read_latest
    from storage.shard_reader import read_stage_columns

    config = write_config(tmp_path, "tiny", tracking={"register_model": "tiny-policy", "log_model": True})
    # MLflow's monitor publishes a sample only after one interval; with the libraries already
    # imported by earlier tests of the process, the whole run can take about a second
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.1")
    # shard writes made slow enough to tell whether a stage's seconds include them
    from storage.shard_writer import ShardWriter

    write = ShardWriter.write

    def slow_write(self, columns):
        time.sleep(0.3)
        return write(self, columns)

    monkeypatch.setattr(ShardWriter, "write", slow_write)
    summary = sdpo_run(str(config), [])

    layout = RunLayout(str(tmp_path / "runs"), "tiny")
    assert read_latest(layout) == 2
    manifest = read_iteration_manifest(layout, 2)
    assert set(manifest.data["stages"]) == {"rollout", "teacher", "train"}
    assert manifest.data["previous"] is not None

    cols = read_stage_columns(layout, 2, "teacher")
    n = 4 * 4
    assert len(cols["sample_id"]) == n
    # the teacher stage's shards store its own columns alone; the rollout's come joined when read
    import pyarrow.parquet as pq

    from storage.schemas import TEACHER

    for shard in sorted((tmp_path / "runs" / "tiny" / "iter-2" / "teacher").glob("*.parquet")):
        stored = pq.ParquetFile(shard).schema_arrow.names
        assert stored == list(TEACHER.names) and not {"prompt_ids", "response_ids", "reward"} & set(stored)
    assert list(cols) == list(TEACHER.view_names)
    for i in range(n):
        t = len(cols["response_ids"][i])
        assert cols["topk_ids"][i].shape == (t, 8)
        assert cols["teacher_topk_logprobs"][i].shape == (t, 8)
        assert len(cols["teacher_sampled_logprobs"][i]) == t
        # the teacher sequence ends with the student's exact response ids
        assert cols["teacher_prompt_text"][i].endswith("<|im_start|>assistant\n")
    assert np.isfinite(np.concatenate([np.asarray(x).ravel() for x in cols["teacher_topk_logprobs"]])).all()

    from storage.manifest import read_stage_manifest

    for stage, compute in (("rollout", "rollout/seconds"), ("teacher", "teacher/score_seconds")):
        metrics = read_stage_manifest(layout, 2, stage).data["metrics"]
        assert metrics[f"{stage}/write_seconds"] >= 0.3
        # the stage's seconds run through its shards written
        assert metrics[f"{stage}/stage_seconds"] >= metrics[compute] + metrics[f"{stage}/write_seconds"]

    records = lineage(layout)
    assert [r.iteration for r in records if r.kind == "policy"] == [0, 1, 2]

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("sdpo").experiment_id])
    assert len(runs) == 1
    history = client.get_metric_history(runs[0].info.run_id, "rollout/reward_mean")
    assert [m.step for m in history] == [1, 2]
    assert "eval/greedy_accuracy" in runs[0].data.metrics
    assert runs[0].data.params["loss.alpha"] == "0.5"
    assert "system/cpu_utilization_percentage" in runs[0].data.metrics
    assert "loss/sdpo" in runs[0].data.metrics and "loss/total" not in runs[0].data.metrics
    # the prompt sets as dataset inputs, the final policy as a registered transformers model
    contexts = {i.tags[0].value: i.dataset.name for i in runs[0].inputs.dataset_inputs}
    assert contexts == {"training": "tiny-training", "evaluation": "tiny-evaluation"}
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    models = {
        m.name for m in mlflow.search_logged_models(experiment_ids=[runs[0].info.experiment_id], output_format="list")
    }
    assert "policy" in models
    # the final policy carries the metrics of the iteration that produced it, its evaluation among them
    (policy,) = mlflow.search_logged_models(
        experiment_ids=[runs[0].info.experiment_id], filter_string="name = 'policy'", output_format="list"
    )
    evaluated = {m.step: m.value for m in client.get_metric_history(runs[0].info.run_id, "eval/greedy_accuracy")}
    by_name = {m.key: m for m in policy.metrics}
    assert by_name["eval/greedy_accuracy"].step == 2 and by_name["eval/greedy_accuracy"].value == evaluated[2]
    assert {m.step for m in policy.metrics} == {2}
    (version,) = client.search_model_versions("name='tiny-policy'")
    loaded = mlflow.transformers.load_model(f"models:/tiny-policy/{version.version}", return_type="components")
    assert {"model", "tokenizer"} <= set(loaded) and loaded["model"].config.vocab_size >= len(loaded["tokenizer"])
    assert set(summary["stage_seconds"]) == {"rollout", "teacher", "train"}
    assert 0.0 <= summary["after"]["eval/greedy_accuracy"] <= 1.0


def test_rerunning_a_finished_run_changes_nothing_and_a_changed_config_is_refused(tmp_path, prefect_server):
    from flows.run import sdpo_run
    from storage.errors import ConfigMismatchError
    from storage.layout import RunLayout
    from storage.manifest import read_iteration_manifest

    config = write_config(tmp_path, "again")
    sdpo_run(str(config), ["iterations=1"])
    layout = RunLayout(str(tmp_path / "runs"), "again")
    digest = read_iteration_manifest(layout, 1).sha256
    with pytest.raises(ConfigMismatchError, match="loss.alpha"):
        sdpo_run(str(config), ["iterations=1", "loss.alpha=0.25"])
    sdpo_run(str(config), ["iterations=1"])
    assert read_iteration_manifest(layout, 1).sha256 == digest


def test_an_accepted_config_change_is_tagged_on_the_mlflow_run_once(tmp_path, prefect_server):
    from mlflow.tracking import MlflowClient

    from flows.run import sdpo_run

    config = write_config(tmp_path, "changed")
    sdpo_run(str(config), ["iterations=1"])
    sdpo_run(str(config), ["iterations=2", "optimizer.lr=0.002"], allow_config_change=True)
    sdpo_run(str(config), ["iterations=2", "optimizer.lr=0.002"])  # same config again: nothing new
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("sdpo").experiment_id])
    tags = run.data.tags
    assert tags["sdpo.config_changes"] == "1" and "sdpo.config_change.2" not in tags
    assert "iterations: 1 -> 2" in tags["sdpo.config_change.1"]
    assert "optimizer.lr: 0.001 -> 0.002" in tags["sdpo.config_change.1"]
    assert run.data.params["optimizer.lr"] == "0.001"  # MLflow params are immutable: the tag says what changed
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "tracking/step")]
    assert steps == [0, 1, 2]


def test_grpo_baseline_runs_on_the_same_machinery(tmp_path, prefect_server):
    from flows.run import sdpo_run

    config = write_config(tmp_path, "grpo", loss={"type": "grpo"})
    summary = sdpo_run(str(config), ["iterations=1"])
    assert "grpo/clip_fraction" in summary["iterations"]["1"]


def _committed_mtimes(run: Path) -> dict[Path, int]:
    """The rollout stages' files and their mtimes, without the temporary sibling a write killed
    between its link and its unlink may leave (`.<name>.tmp+...`), which the restart clears."""
    return {p: p.stat().st_mtime_ns for p in run.rglob("rollout/*") if not p.name.startswith(".")}


def _recorded(mlflow_db: Path, layout) -> dict[str, str]:
    """The manifest digests the run's MLflow run records (empty before it exists)."""
    from flows.cli.audit import recorded_digests

    if not mlflow_db.exists():
        return {}
    found = recorded_digests(f"sqlite:///{mlflow_db}", "sdpo", layout.run_url)
    return {} if found is None else found[1]


def test_sigkill_after_rollout_then_restart_reuses_the_rollout_shards(tmp_path, prefect_server):
    from storage.layout import RunLayout
    from storage.manifest import read_iteration_manifest, read_latest, read_stage_manifest, stage_done

    config = write_config(tmp_path, "killed")
    layout = RunLayout(str(tmp_path / "runs"), "killed")
    env = dict(os.environ, PREFECT_API_URL=prefect_server, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "flows.cli", "run", str(config)]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**env, "SDPO_PAUSE_AT": "stage.start:teacher@2"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    rollout = layout.relative(layout.stage_manifest(2, "rollout"))
    try:
        # killed from outside once the rollout is committed and recorded in the run's tracking record
        # (one not recorded yet is computed again: tests/unit/test_storage_anchor.py), the teacher
        # stage held at its start
        while not (stage_done(layout, 2, "rollout") and rollout in _recorded(tmp_path / "mlflow.db", layout)):
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "iteration 2 rollout never committed"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert read_latest(layout) == 1
    rollout_before = read_stage_manifest(layout, 2, "rollout")
    mtimes = _committed_mtimes(tmp_path / "runs" / "killed")

    # the killed process left its lock behind: the same command takes it over by itself, saying so
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "took over stale lock" in done.stdout + done.stderr and "is gone" in done.stdout + done.stderr
    assert read_latest(layout) == 2
    assert read_stage_manifest(layout, 2, "rollout").sha256 == rollout_before.sha256
    assert _committed_mtimes(tmp_path / "runs" / "killed") == mtimes
    it2 = read_iteration_manifest(layout, 2)
    assert it2.data["stages"]["rollout"]["sha256"] == rollout_before.sha256
    assert it2.data["previous"]["sha256"] == read_iteration_manifest(layout, 1).sha256


def test_a_run_on_s3_keeps_everything_in_the_bucket_and_credentials_out_of_it(
    tmp_path, prefect_server, s3_server, monkeypatch
):
    from flows.run import sdpo_run
    from storage.checkpoints import lineage
    from storage.layout import RunLayout, read_run
    from storage.manifest import read_latest

    full = s3_server.storage_options()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", full["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", full["secret"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", full["client_kwargs"]["region_name"])
    bucket = s3_server.make_bucket()
    root = f"s3://{bucket}/runs"
    config = write_config(
        tmp_path, "ons3", root=root, storage={"storage_options": {"endpoint_url": s3_server.endpoint_url}}
    )
    sdpo_run(str(config), ["iterations=1"])

    layout = RunLayout(root, "ons3", storage_options=s3_server.storage_options())
    assert read_latest(layout) == 1
    assert [r.iteration for r in lineage(layout) if r.kind == "policy"] == [0, 1]
    assert full["secret"] not in json.dumps(read_run(layout))
    assert not (tmp_path / "runs").exists()


def test_megatron_teacher_backend_scores_like_the_embedded_scorer(tmp_path, prefect_server):
    from flows.run import sdpo_run
    from storage.layout import RunLayout
    from storage.shard_reader import read_stage_columns

    sdpo_run(str(write_config(tmp_path, "hf-teacher")), ["iterations=1"])
    sdpo_run(str(write_config(tmp_path, "mc-teacher", teacher={"backend": "megatron"})), ["iterations=1"])
    a = read_stage_columns(RunLayout(str(tmp_path / "runs"), "hf-teacher"), 1, "teacher")
    b = read_stage_columns(RunLayout(str(tmp_path / "runs"), "mc-teacher"), 1, "teacher")
    assert [list(x) for x in a["response_ids"]] == [list(x) for x in b["response_ids"]]
    for x, y in zip(a["teacher_topk_logprobs"], b["teacher_topk_logprobs"], strict=True):
        np.testing.assert_allclose(x, y, atol=1e-4)
