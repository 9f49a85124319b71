"""`sdpo fork`: a run started from a committed iteration of another continues it bit for bit, and
knows its parent (lineage, MLflow)."""

from __future__ import annotations

from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from flows.cli import app
from tests.integration.runs import final_policy_sha, fingerprint, write_config


def _of_iteration(digests: dict[str, str], n: int) -> dict[str, str]:
    return {p: d for p, d in digests.items() if p.startswith((f"iter-{n}/", f"checkpoints/iter-{n}/"))}


def test_a_fork_continues_its_parent_bit_for_bit_and_records_it(tmp_path, prefect_server):
    from flows.run import sdpo_run
    from storage.layout import RunLayout
    from storage.manifest import read_latest

    root = str(tmp_path / "runs")
    sdpo_run(str(write_config(tmp_path, "parent", iterations=3)), [])
    parent = RunLayout(root, "parent")
    runner = CliRunner()

    refused = runner.invoke(app, ["fork", "parent", "--from-iteration", "4", "--name", "late", "--root", root])
    assert refused.exit_code == 2 and "committed iterations 1..3" in refused.output

    child_yaml = tmp_path / "child.yaml"
    forked = runner.invoke(  # a setting that changes no result: the fork still continues bit for bit
        app,
        ["fork", "parent", "--from-iteration", "2", "--name", "child", "--root", root, "--config-out", str(child_yaml)]
        + ["tracking.system_metrics=false"],
    )
    assert forked.exit_code == 0, forked.output
    child = RunLayout(root, "child")
    assert read_latest(child) == 2
    assert _of_iteration(fingerprint(child)["digests"], 2) == _of_iteration(fingerprint(parent)["digests"], 2)
    again = runner.invoke(
        app,
        [
            "fork",
            "parent",
            "--from-iteration",
            "2",
            "--name",
            "child",
            "--root",
            root,
            "--config-out",
            str(tmp_path / "c2.yaml"),
        ],
    )
    assert again.exit_code == 2 and "already exists" in again.output
    status = runner.invoke(app, ["status", "child", "--root", root])
    assert "LATEST = 2 of 3" in status.output and "lock: free" in status.output
    assert "stopped in iteration 3 at rollout" in status.output

    sdpo_run(str(child_yaml), [])
    a, b = fingerprint(parent), fingerprint(child)
    assert _of_iteration(b["digests"], 3) and _of_iteration(b["digests"], 3) == _of_iteration(a["digests"], 3)
    assert final_policy_sha(child) == final_policy_sha(parent)
    assert b["evals"][3] == a["evals"][3]

    lineage = runner.invoke(app, ["lineage", "child", "--root", root])
    assert lineage.exit_code == 0 and f"forked from {parent.run_url} at iteration 2" in lineage.output

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("sdpo").experiment_id
    found = client.search_runs([experiment])
    runs = {r.data.tags["sdpo.run_url"].rsplit("/", 1)[1]: r for r in found}
    # named for its parent and what it changed: its curves are told from its parent's in the UI's charts
    changed = "tracking.system_metrics true -> false"
    assert runs["child"].info.run_name == f"child (fork of parent at 2: {changed})"
    assert runs["parent"].info.run_name == "parent"
    tags = runs["child"].data.tags
    assert tags["sdpo.parent_run_url"] == parent.run_url and tags["sdpo.forked_from_iteration"] == "2"
    # a top-level run (the UI's charts plot it without expanding the parent), linked to its parent
    assert "mlflow.parentRunId" not in tags and tags["sdpo.parent_mlflow_run_id"] == runs["parent"].info.run_id
    history = client.get_metric_history(runs["child"].info.run_id, "tracking/step")
    assert [m.step for m in history] == [0, 1, 2, 3]
    # its description links the parent's run in the UI's training view and says what changed
    parent_link = f"#/experiments/{experiment}/runs/{runs['parent'].info.run_id}?workflowType=machine_learning"
    assert f"[parent]({parent_link}) at iteration 2; changed: {changed}." in tags["mlflow.note.content"]

    # `sdpo compare` names the fork with what it changed, in its output and in the plot's legend
    from tasks.tracking.compare import read_history

    plot = tmp_path / "compare.png"
    compared = runner.invoke(app, ["compare", "parent", "child", "--root", root, "--plot", str(plot)])
    assert compared.exit_code == 0, compared.output
    assert f"child: fork of parent at iteration 2 ({changed})" in " ".join(compared.output.split())
    assert read_history(root, "parent").label == "parent (sdpo, seed 3)"
    assert read_history(root, "child").label == f"child (sdpo, seed 3)\n  fork of parent at 2: {changed}"
