"""`eval.enabled: false`: a run evaluates nothing, not even the base model or its last iteration."""

from __future__ import annotations

from tests.integration.runs import TINY, write_config


def test_a_run_without_evaluation_commits_no_eval_and_logs_no_eval_metric(tmp_path, prefect_server):
    import mlflow

    from flows.run import sdpo_run
    from storage.layout import RunLayout
    from storage.manifest import stage_done

    config = write_config(tmp_path, "noeval", base={**TINY, "iterations": 1}, eval={"enabled": False, "every": 0})
    sdpo_run(str(config), [])
    layout = RunLayout(str(tmp_path / "runs"), "noeval")
    assert stage_done(layout, 1, "train")
    assert not stage_done(layout, 0, "eval") and not stage_done(layout, 1, "eval")
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("sdpo").experiment_id])
    assert "train/seconds" in run.data.metrics
    assert not [k for k in run.data.metrics if k.startswith("eval/")]
