"""MLflow tracking and run views: one store per storage root, loss metrics named by loss type,
source tags, the summary of a run advanced step by step, Prefect artifact contents."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from flows.artifacts import artifact_key, iteration_markdown, mlflow_run_link
from tasks.config import build_config
from tasks.tracking.experiment import Tracker, metric_names, source_tags, tracking_uri
from tasks.tracking.summary import RunSummary, render_table

REPO = Path(__file__).resolve().parents[2]


def _cfg(tmp_path: Path, **tree):
    return build_config({"storage": {"root": str(tmp_path / "runs"), "cache_dir": str(tmp_path / "cache")}, **tree})


def test_runs_under_one_root_share_one_store_beside_the_runs(tmp_path):
    root = tmp_path / "runs"
    sdpo = _cfg(tmp_path, name="demo")
    grpo = _cfg(tmp_path, name="demo-grpo", loss={"type": "grpo"})
    a, b = (Tracker(c, f"file://{root}/{c.name}", local_root_dir=root) for c in (sdpo, grpo))
    assert a.uri == b.uri == f"sqlite:///{root / 'mlflow.db'}"
    assert a.experiment_id == b.experiment_id and a.run_id != b.run_id


def test_an_object_store_root_tracks_under_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert tracking_uri(_cfg(tmp_path), local_root_dir=None) == f"sqlite:///{tmp_path / '.sdpo' / 'mlflow.db'}"


def test_a_configured_uri_wins(tmp_path):
    cfg = _cfg(tmp_path, tracking={"uri": "sqlite:////elsewhere/m.db"})
    assert tracking_uri(cfg, local_root_dir=tmp_path) == "sqlite:////elsewhere/m.db"


@pytest.mark.parametrize("loss", ["sdpo", "grpo", "blend"])
def test_loss_totals_are_named_by_their_loss(loss):
    named = metric_names(
        {"loss/total": 1.0, "train/loss": 2.0, "sdpo/loss": 3.0, "rollout/reward_mean": 0.5}, loss_type=loss
    )
    assert named == {f"loss/{loss}": 1.0, f"train/loss_{loss}": 2.0, "sdpo/loss": 3.0, "rollout/reward_mean": 0.5}


def test_logged_steps_carry_the_loss_name_and_the_source_tags(tmp_path):
    root = tmp_path / "runs"
    cfg = _cfg(tmp_path, name="g", loss={"type": "grpo"})
    tracker = Tracker(cfg, f"file://{root}/g", local_root_dir=root)
    tracker.log_step(1, {"loss/total": 0.25})
    run = tracker.client.get_run(tracker.run_id)
    assert run.data.metrics == {"loss/grpo": 0.25, "tracking/step": 1.0}
    assert run.data.tags["mlflow.source.name"] == str(REPO)
    assert run.data.tags["mlflow.source.git.commit"] == source_tags()["mlflow.source.git.commit"]
    assert len(run.data.tags["mlflow.source.git.commit"]) == 40


def test_summary_of_steps_recorded_one_by_one():
    summary = RunSummary(run_url="file:///r/x", tracking_uri="sqlite:///m.db", loss_type="grpo")
    summary.record(0, {"eval/greedy_accuracy": 0.1, "eval/seconds": 2.0})
    summary.record(1, {"rollout/stage_seconds": 3.0, "train/stage_seconds": 4.0})
    summary.record(2, {"rollout/stage_seconds": 1.0, "eval/greedy_accuracy": 0.5, "eval/seconds": 1.0})
    summary.close(2)
    assert summary.before["eval/greedy_accuracy"] == 0.1
    assert summary.after == {"eval/greedy_accuracy": 0.5, "eval/seconds": 1.0}
    assert summary.seconds == pytest.approx(3.0 + 4.0 + 1.0 + 2.0 + 1.0)
    assert render_table(summary.as_dict()).title == "GRPO run file:///r/x"


def test_artifact_keys_are_what_prefect_accepts():
    assert artifact_key("Demo_run.v2", "samples") == "sdpo-demo-run-v2-samples"


def test_iteration_markdown_has_metrics_coverage_stage_times_and_links(tmp_path):
    run = SimpleNamespace(cfg=_cfg(tmp_path, name="demo", iterations=6))
    tracker = SimpleNamespace(enabled=True, ui_url="http://127.0.0.1:5000/", experiment_id="1", run_id="abc")
    link = mlflow_run_link(tracker)
    assert link == "http://127.0.0.1:5000/#/experiments/1/runs/abc?workflowType=machine_learning"
    metrics = {
        "rollout/reward_mean": 0.5,
        "teacher/sample_mask_fraction": 0.75,
        "train/stage_seconds": 12.0,
        "loss/total": 0.1,
    }
    text = iteration_markdown(
        run, 3, metrics, mlflow_link=link, checkpoint_url="file:///runs/demo/checkpoints/iter-3/policy"
    )
    assert "iteration 3 of 6 (sdpo loss)" in text and "**75%**" in text
    assert "| `rollout/reward_mean` | 0.5 |" in text and "| train | 12.0 |" in text
    assert f"]({link})" in text and "iter-3/policy" in text
    assert mlflow_run_link(SimpleNamespace(enabled=True, ui_url=None)) is None


def _rows(n: int) -> list[dict]:
    return [
        {"group_id": i // 2, "prompt": f"2+{i}=?", "response": 'é\n"x"', "reward": 0.5 * i, "sample_mask": i % 2 == 0}
        for i in range(n)
    ]


def _download(run_id: str, path: str, dst: Path) -> bytes:
    import mlflow

    return Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=path, dst_path=str(dst))).read_bytes()


def test_a_sample_table_is_what_mlflow_log_table_writes_and_is_written_once(tmp_path):
    """The table file and the `mlflow.loggedArtifacts` tag equal those of `mlflow.log_table` for
    the same rows; a step's table is written once, and a tracker opened later (a resumed run)
    knows which steps have theirs."""
    import mlflow
    from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS

    root = tmp_path / "runs"
    cfg = _cfg(tmp_path, name="t")
    tracker = Tracker(cfg, f"file://{root}/t", local_root_dir=root)
    rows = _rows(5)
    assert not tracker.has_samples(1)
    tracker.log_samples(1, rows)
    tracker.log_samples(1, rows[:2])  # already there: neither appended to nor rewritten
    tracker.log_samples(2, rows[:3])
    theirs = tracker.client.create_run(tracker.experiment_id).info.run_id
    for n, part in ((1, rows), (2, rows[:3])):
        columns = {key: [row[key] for row in part] for key in part[0]} | {"iteration": [n] * len(part)}
        mlflow.log_table(columns, artifact_file=f"samples/iter-{n:04d}.json", run_id=theirs)
        path = f"samples/iter-{n:04d}.json"
        assert _download(tracker.run_id, path, tmp_path / f"ours{n}") == _download(
            theirs, path, tmp_path / f"theirs{n}"
        )
    tags = [tracker.client.get_run(r).data.tags[MLFLOW_LOGGED_ARTIFACTS] for r in (tracker.run_id, theirs)]
    assert tags[0] == tags[1]
    loaded = tracker.client.load_table(tracker.experiment_id, "samples/iter-0001.json", run_ids=[tracker.run_id])
    assert list(loaded["prompt"]) == [r["prompt"] for r in rows]

    resumed = Tracker(cfg, f"file://{root}/t", local_root_dir=root)
    assert resumed.run_id == tracker.run_id
    assert resumed.has_samples(1) and resumed.has_samples(2) and not resumed.has_samples(3)


def test_a_long_run_keeps_every_sample_table_and_a_tag_mlflow_can_read(tmp_path):
    """`mlflow.log_table` breaks the run's table tag at the 152nd table (MLflow cuts a tag value at
    8,000 characters; the next call cannot parse it). Every table is stored; the tag stays valid
    JSON and lists the newest; a table stored without its tag entry (a kill between the two) is
    listed once a tracker opens the run again."""
    import json

    from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS

    root = tmp_path / "runs"
    cfg = _cfg(tmp_path, name="long")
    tracker = Tracker(cfg, f"file://{root}/long", local_root_dir=root)
    for step in range(1, 201):
        tracker.log_samples(step, _rows(1))
    stored = {a.path for a in tracker.client.list_artifacts(tracker.run_id, "samples")}
    assert stored == {f"samples/iter-{n:04d}.json" for n in range(1, 201)}
    tag = tracker.client.get_run(tracker.run_id).data.tags[MLFLOW_LOGGED_ARTIFACTS]
    listed = [t["path"] for t in json.loads(tag)]
    assert len(tag) <= 8000 and len(listed) > 140
    assert listed == [f"samples/iter-{n:04d}.json" for n in range(201 - len(listed), 201)]

    tracker.client.log_text(tracker.run_id, "{}", "samples/iter-0201.json")  # the file, then a kill
    resumed = Tracker(cfg, f"file://{root}/long", local_root_dir=root)
    assert all(resumed.has_samples(n) for n in range(1, 202))
    tag = json.loads(resumed.client.get_run(resumed.run_id).data.tags[MLFLOW_LOGGED_ARTIFACTS])
    assert tag[-1] == {"path": "samples/iter-0201.json", "type": "table"}


def test_the_tables_tag_lists_the_newest_tables_that_fit_in_numeric_order():
    import json

    from tasks.tracking.experiment import samples_file, tables_tag

    files = {samples_file(n) for n in range(9_900, 10_100)}  # the names gain a digit at 10,000
    tag = tables_tag(files)
    listed = [t["path"] for t in json.loads(tag)]
    assert len(tag) <= 8000 and len(json.dumps(json.loads(tag) + [{"path": samples_file(0), "type": "table"}])) > 8000
    assert listed == [samples_file(n) for n in range(10_100 - len(listed), 10_100)]
    assert tables_tag([]) == "[]"


def test_the_experiment_opens_on_the_training_runs_view(tmp_path):
    """The MLflow UI opens an experiment by its `mlflow.experimentKind` tag; without one it may open
    the GenAI (traces) view. A user's explicit choice is kept."""
    from mlflow.tracking import MlflowClient

    root = tmp_path / "runs"
    tracker = Tracker(_cfg(tmp_path, name="a"), f"file://{root}/a", local_root_dir=root)
    kind = tracker.client.get_experiment(tracker.experiment_id).tags["mlflow.experimentKind"]
    assert kind == "custom_model_development"

    elsewhere = f"sqlite:///{tmp_path / 'other.db'}"
    client = MlflowClient(elsewhere)
    bare = client.create_experiment("sdpo")  # as an earlier version created it: no kind
    chosen = client.create_experiment("chosen", tags={"mlflow.experimentKind": "genai_development"})
    Tracker(_cfg(tmp_path, name="b", tracking={"uri": elsewhere}), "file:///b", local_root_dir=None)
    Tracker(
        _cfg(tmp_path, name="c", tracking={"uri": elsewhere, "experiment": "chosen"}), "file:///c", local_root_dir=None
    )
    assert client.get_experiment(bare).tags["mlflow.experimentKind"] == "custom_model_development"
    assert client.get_experiment(chosen).tags["mlflow.experimentKind"] == "genai_development"


def test_a_fork_is_a_top_level_run_linked_to_its_parent(tmp_path):
    """Nested under its parent (`mlflow.parentRunId`), a fork's curves show in the UI's charts only
    once the parent row is expanded; a fork is a run of its own, linked by tags and its description."""
    root = tmp_path / "runs"
    parent = Tracker(_cfg(tmp_path, name="parent"), f"file://{root}/parent", local_root_dir=root)
    child = Tracker(_cfg(tmp_path, name="child"), f"file://{root}/child", local_root_dir=root)
    child.set_tags({"mlflow.parentRunId": parent.run_id})  # as an earlier version nested it
    fork = {"parent": "parent", "parent_run_url": f"file://{root}/parent", "iteration": 2}
    child.record_fork({**fork, "changes": [["loss.alpha", 0.5, 1.0]]})
    tags = child.client.get_run(child.run_id).data.tags
    assert "mlflow.parentRunId" not in tags
    assert tags["sdpo.parent_mlflow_run_id"] == parent.run_id
    assert tags["sdpo.parent_run_url"] == f"file://{root}/parent" and tags["sdpo.forked_from_iteration"] == "2"
    # the description's link opens the parent in the UI's training view, whatever port the UI is on
    assert (
        f"Forked from [parent](#/experiments/{child.experiment_id}/runs/{parent.run_id}?workflowType=machine_learning) at "
        "iteration 2; changed: loss.alpha 0.5 -> 1.0." == tags["mlflow.note.content"]
    )
    top_level = child.client.search_runs([child.experiment_id], filter_string="tags.`mlflow.parentRunId` IS NULL")
    # the fork's name tells its curves from its parent's in the charts' legend
    assert {r.info.run_name for r in top_level} == {"parent", "child (fork of parent at 2: loss.alpha 0.5 -> 1.0)"}
    child.record_fork(fork)  # a fork.json of a version that did not record the changes
    assert (
        child.client.get_run(child.run_id).info.run_name == "child (fork of parent at 2: its changes are not recorded)"
    )


def test_a_store_moved_with_its_runs_folder_finds_its_runs_and_their_artifacts(tmp_path, caplog):
    """The store records absolute places (artifact locations, the SDPO run's URL): opened where the
    runs folder was copied (or moved) to, it rewrites them, says so, and goes on with the same run."""
    import shutil

    old, new = tmp_path / "a", tmp_path / "b"
    first = Tracker(_cfg(old, name="demo"), f"file://{old}/runs/demo", local_root_dir=old / "runs")
    (tmp_path / "notes.txt").write_text("kept")
    first.log_artifact(tmp_path / "notes.txt")
    first.finish()
    shutil.copytree(old / "runs", new / "runs")  # a copy: the original stays where it was
    again = Tracker(_cfg(new, name="demo"), f"file://{new}/runs/demo", local_root_dir=new / "runs")
    assert again.run_id == first.run_id  # found by its run URL: no second MLflow run
    run = again.client.get_run(again.run_id)
    assert run.info.artifact_uri == f"{(new / 'runs' / 'mlartifacts').as_uri()}/{again.run_id}/artifacts"
    assert [a.path for a in again.client.list_artifacts(again.run_id)] == ["notes.txt"]
    assert again.client.get_experiment(again.experiment_id).artifact_location == (new / "runs" / "mlartifacts").as_uri()
    said = [r.getMessage() for r in caplog.records if "was moved from" in r.getMessage()]
    assert said == [
        f"MLflow store {new / 'runs' / 'mlflow.db'} was moved from {old / 'runs'}: rewrote 3 artifact locations "
        f"and run URLs to {new / 'runs'}"
    ], said
    # once: the next opening finds it where it is
    Tracker(_cfg(new, name="demo"), f"file://{new}/runs/demo", local_root_dir=new / "runs")
    assert len([r for r in caplog.records if "was moved from" in r.getMessage()]) == 1
    # the original's store is untouched
    original = Tracker(_cfg(old, name="demo"), f"file://{old}/runs/demo", local_root_dir=old / "runs")
    assert original.run_id == first.run_id
    assert original.client.get_run(first.run_id).info.artifact_uri.startswith((old / "runs" / "mlartifacts").as_uri())
