"""Manifests record the digest of their content when written; what a resumed run adopts is checked."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import numpy as np
import pytest

from storage import ROLLOUT, RunLayout, ShardWriter, StageOutput, create_or_open_run, upload_checkpoint, write_eval
from storage.adopt import adopt_commit_inputs, adopt_iteration_manifest, adopt_latest, adopt_stage
from storage.errors import CorruptManifestError, DamagedOutputError
from storage.manifest import commit_iteration, content_digest, read_manifest, read_stage_manifest
from storage.synthetic import synthetic_columns


@pytest.fixture(params=["memory", "file"])
def layout(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RunLayout]:
    root = str(tmp_path / "runs") if request.param == "file" else f"memory://adopt-{uuid.uuid4().hex}"
    layout = RunLayout(root, "run")
    create_or_open_run(layout, {"lr": 1e-6})
    yield layout
    memory = fsspec.filesystem("memory")
    if request.param == "memory" and memory.exists(root):
        memory.rm(root, recursive=True)


def _iteration(layout: RunLayout, n: int, tmp_path: Path, *, through: str = "train") -> None:
    """Stages of iteration n up to `through`, and the policy checkpoint the train stage names."""
    output = StageOutput(layout, n, "rollout")
    with ShardWriter(output, ROLLOUT, top_k=4, rows_per_shard=4, row_group_size=2) as writer:
        writer.write(synthetic_columns(iteration=n, n_rows=6, top_k=4, rng=np.random.default_rng(n), vocab=500))
    rollout = output.commit(metrics={"rollout/reward_mean": 0.5})
    if through == "rollout":
        return
    teacher = StageOutput(layout, n, "teacher")
    teacher.write_json("scores.json", {"n": n})
    committed = teacher.commit(parents=[rollout])
    if through == "teacher":
        return
    (tmp_path / f"w{n}").mkdir(exist_ok=True)
    (tmp_path / f"w{n}" / "model.safetensors").write_bytes(b"w" * (n + 1))
    policy = upload_checkpoint(tmp_path / f"w{n}", layout, n, "policy", parent="base", trained_on=[committed])
    StageOutput(layout, n, "train").commit(parents=[committed, policy], metrics={"train/loss": 0.3})


def _edit(layout: RunLayout, url: str, change: dict) -> None:
    """Rewrite the manifest at `url` with `change` applied, as valid JSON in the same format."""
    data = json.loads(layout.store.read_bytes(url))
    data.update(change)
    layout.store.write_bytes(url, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode())


def test_a_manifest_records_the_digest_of_its_content_and_reads_check_it(layout: RunLayout, tmp_path: Path) -> None:
    _iteration(layout, 1, tmp_path, through="rollout")
    url = layout.stage_manifest(1, "rollout")
    data = json.loads(layout.store.read_bytes(url))
    assert data["manifest_version"] == 2 and data["content_sha256"] == content_digest(data)
    # the same content laid out otherwise is the same content
    layout.store.write_bytes(url, json.dumps(data).encode())
    assert read_manifest(layout, url).data == data
    _edit(layout, url, {"metrics": {"rollout/reward_mean": 1.0}})
    with pytest.raises(CorruptManifestError, match="was changed after it was written") as err:
        read_manifest(layout, url)
    assert url in str(err.value)
    _edit(layout, url, {"content_sha256": None})
    with pytest.raises(CorruptManifestError, match="has no content_sha256"):
        read_manifest(layout, url)


def test_a_manifest_of_version_1_passes_only_in_a_run_created_before_the_content_digest(layout: RunLayout) -> None:
    """A run created since every manifest records its content digest (run.json's layout version 2)
    holds no version-1 manifest: one is an edit (the digest removed, the version set back)."""
    url = layout.stage_manifest(1, "teacher")
    layout.store.write_bytes(url, json.dumps({"manifest_version": 1, "kind": "stage", "files": []}).encode())
    with pytest.raises(CorruptManifestError, match="has no content_sha256 .*a run created since holds no other"):
        read_manifest(layout, url)
    record = json.loads(layout.store.read_bytes(layout.run_json))
    layout.store.write_bytes(layout.run_json, json.dumps({**record, "layout_version": 1}).encode())
    assert read_manifest(layout, url)["files"] == []


def test_an_adopted_stage_is_checked_file_by_file(layout: RunLayout, tmp_path: Path) -> None:
    _iteration(layout, 1, tmp_path, through="teacher")
    assert adopt_stage(layout, 1, "rollout") == read_stage_manifest(layout, 1, "rollout")
    shard = layout.shard(1, "rollout", 1)
    original = layout.store.read_bytes(shard)
    layout.store.write_bytes(shard, original[:-1] + bytes([original[-1] ^ 1]))
    with pytest.raises(DamagedOutputError, match="sha256 mismatch") as err:
        adopt_stage(layout, 1, "rollout")
    assert err.value.url == shard
    message = str(err.value)
    assert shard in message and f"sdpo verify run --root {layout.root_url}" in message
    # the stage and the one computed from it (the train stage has no folder yet)
    assert f"delete {layout.stage_dir(1, 'rollout')}, {layout.stage_dir(1, 'teacher')} and run" in message
    adopt_stage(layout, 1, "rollout", hash_files=False)  # sizes only: the same size passes
    layout.store.write_bytes(shard, original[:-1])
    with pytest.raises(DamagedOutputError, match=f"{len(original) - 1} bytes"):
        adopt_stage(layout, 1, "rollout", hash_files=False)
    layout.store.remove_file(shard)
    with pytest.raises(DamagedOutputError, match="but missing"):
        adopt_stage(layout, 1, "rollout")


def test_an_adopted_stage_whose_parent_changed_is_refused(layout: RunLayout, tmp_path: Path) -> None:
    """The rollout redone after the teacher read it (a new manifest, another digest)."""
    _iteration(layout, 1, tmp_path, through="teacher")
    layout.store.remove_tree(layout.stage_dir(1, "rollout"))
    _iteration(layout, 1, tmp_path, through="rollout")
    with pytest.raises(DamagedOutputError, match="sha256 mismatch") as err:
        adopt_stage(layout, 1, "teacher")
    assert err.value.url == layout.stage_manifest(1, "rollout")


def test_the_commit_checks_the_stages_it_names(layout: RunLayout, tmp_path: Path) -> None:
    _iteration(layout, 1, tmp_path)
    stages = ("rollout", "teacher", "train")
    handed = {s: read_stage_manifest(layout, 1, s).sha256 for s in stages}
    assert [m.path for m in adopt_commit_inputs(layout, 1, stages=stages, handed=handed)] == [
        f"iter-1/{s}/_manifest.json" for s in stages
    ]
    with pytest.raises(DamagedOutputError, match="handed the flow 0000") as err:
        adopt_commit_inputs(layout, 1, stages=stages, handed={**handed, "teacher": "0" * 64})
    assert err.value.url == layout.stage_manifest(1, "teacher")
    # a checkpoint manifest the train stage named, edited
    checkpoint = layout.checkpoint_manifest(1, "policy")
    _edit(layout, checkpoint, {"metadata": {"note": "edited"}})
    with pytest.raises(DamagedOutputError, match="stage train does not check out") as err:
        adopt_commit_inputs(layout, 1, stages=stages)
    assert err.value.url == checkpoint


def test_latest_and_an_unfinished_commit_are_checked(layout: RunLayout, tmp_path: Path) -> None:
    assert adopt_latest(layout) is None
    _iteration(layout, 1, tmp_path)
    manifest = commit_iteration(layout, 1, metrics={})
    assert adopt_latest(layout) == 1 and adopt_iteration_manifest(layout, 1) == manifest
    pointer = json.loads(layout.store.read_bytes(layout.latest))
    layout.store.write_bytes(layout.latest, json.dumps({**pointer, "sha256": "0" * 64}).encode())
    with pytest.raises(DamagedOutputError, match="LATEST does not check out") as err:
        adopt_latest(layout)
    assert err.value.url == layout.latest and f"delete {layout.latest}" in str(err.value)
    layout.store.write_bytes(layout.stage_manifest(1, "train"), b"{}")
    with pytest.raises(DamagedOutputError, match="LATEST not moved") as err:
        adopt_iteration_manifest(layout, 1)
    assert err.value.url == layout.stage_manifest(1, "train")


def test_the_evaluation_file_leaves_out_wall_clock_metrics(layout: RunLayout) -> None:
    write_eval(layout, 0, {"eval/greedy_accuracy": 0.25, "eval/seconds": 3.5, "eval/tokens_per_second": 9.0})
    assert json.loads(layout.store.read_bytes(layout.stage_file(0, "eval", "metrics.json"))) == {
        "eval/greedy_accuracy": 0.25
    }
    assert read_stage_manifest(layout, 0, "eval")["metrics"]["eval/seconds"] == 3.5
