"""Manifests and commits: written last, never overwritten, partial outputs redone, LATEST in order."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import numpy as np
import pytest

from storage import (
    ROLLOUT,
    AlreadyCommittedError,
    ChecksumMismatchError,
    NotCommittedError,
    RunLayout,
    ShardWriter,
    StageOutput,
    commit_iteration,
    config_hash,
    create_or_open_run,
    iteration_committed,
    read_eval,
    read_iteration_manifest,
    read_latest,
    read_run_config,
    read_stage_file,
    read_stage_manifest,
    read_table,
    stage_done,
    upload_checkpoint,
    write_eval,
    write_stage_manifest,
)
from storage.hashing import sha256_bytes
from storage.manifest import plain_metrics
from storage.provenance import code_version
from storage.synthetic import synthetic_columns

CONFIG = {"lr": 1e-6}


@pytest.fixture(params=["memory", "file"])
def layout(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RunLayout]:
    root = str(tmp_path / "runs") if request.param == "file" else f"memory://test-{uuid.uuid4().hex}"
    layout = RunLayout(root, "run")
    create_or_open_run(layout, CONFIG)
    yield layout
    memory = fsspec.filesystem("memory")
    if request.param == "memory" and memory.exists(root):
        memory.rm(root, recursive=True)


def _rollout(layout: RunLayout, n: int, *, rows: int = 6, commit: bool = True, seed: int = 0):  # type: ignore
    output = StageOutput(layout, n, "rollout")
    with ShardWriter(output, ROLLOUT, top_k=4, rows_per_shard=4, row_group_size=2) as writer:
        writer.write(synthetic_columns(iteration=n, n_rows=rows, top_k=4, rng=np.random.default_rng(seed), vocab=500))
    return output.commit(metrics={"rollout/reward_mean": 0.5}) if commit else output


def _stage(layout: RunLayout, n: int, stage: str, parents=()):  # type: ignore[no-untyped-def]
    output = StageOutput(layout, n, stage)
    output.write_json("metrics.json", {"stage": stage})
    return output.commit(parents=parents)


def test_stage_manifest_records_files_digests_rows_and_provenance(layout: RunLayout) -> None:
    manifest = _rollout(layout, 0)
    data = manifest.data
    assert manifest.path == "iter-0/rollout/_manifest.json"
    assert manifest.sha256 == sha256_bytes(layout.store.read_bytes(layout.stage_manifest(0, "rollout")))
    assert [f["path"] for f in data["files"]] == [
        "iter-0/rollout/part-00000.parquet",
        "iter-0/rollout/part-00001.parquet",
    ]
    assert [f["rows"] for f in data["files"]] == [4, 2] and data["rows"] == 6
    for entry in data["files"]:
        payload = layout.store.read_bytes(layout.url(entry["path"]))
        assert entry["sha256"] == sha256_bytes(payload) and entry["bytes"] == len(payload)
    assert data["bytes"] == sum(f["bytes"] for f in data["files"])
    assert data["schema"]["name"] == "rollout" and data["schema"]["version"] == 1 and data["schema"]["top_k"] == 4
    assert data["config_hash"] == config_hash(CONFIG)
    assert data["code_version"] == code_version() and data["code_version"]
    assert data["metrics"] == {"rollout/reward_mean": 0.5}
    assert data["timings"]["wall_s"] >= 0 and data["created_at"].endswith("+00:00")
    assert data["parents"] == [] and data["iteration"] == 0 and data["stage"] == "rollout"


def test_committed_stage_is_never_overwritten(layout: RunLayout) -> None:
    _rollout(layout, 0)
    with pytest.raises(AlreadyCommittedError, match="never overwritten"):
        StageOutput(layout, 0, "rollout")


def test_concurrent_commit_of_same_stage_loses_cleanly(layout: RunLayout) -> None:
    first, second = StageOutput(layout, 0, "train"), StageOutput(layout, 0, "train")
    first.write_json("a.json", {})
    second.write_json("b.json", {})
    first.commit()
    with pytest.raises(AlreadyCommittedError):
        second.commit()


def test_partial_stage_is_invisible_then_cleared_and_redone(
    layout: RunLayout, caplog: pytest.LogCaptureFixture
) -> None:
    output = StageOutput(layout, 0, "rollout")
    with pytest.raises(RuntimeError, match="crash"), ShardWriter(output, ROLLOUT, top_k=4, row_group_size=2) as writer:
        writer.write(synthetic_columns(iteration=0, n_rows=5, top_k=4, rng=np.random.default_rng(0), vocab=500))
        raise RuntimeError("crash")
    leftovers = layout.store.list_files(layout.stage_dir(0, "rollout"))
    assert leftovers and not stage_done(layout, 0, "rollout")
    with pytest.raises(NotCommittedError):
        read_table(layout, 0, "rollout")
    with caplog.at_level(logging.WARNING, logger="storage.stages"):
        redone = _rollout(layout, 0, rows=3, seed=7)
    assert "no manifest" in caplog.text
    assert redone.data["rows"] == 3 and read_table(layout, 0, "rollout").num_rows == 3
    files = layout.store.list_files(layout.stage_dir(0, "rollout"))
    committed = [f["path"] for f in redone.data["files"]] + [redone.path]
    assert sorted(layout.relative(u) for u in files) == sorted(committed)


def test_parents_are_named_by_digest_and_verified(layout: RunLayout) -> None:
    rollout = _rollout(layout, 0)
    teacher = _stage(layout, 0, "teacher", parents=[rollout])
    assert teacher.data["parents"] == [{"path": "iter-0/rollout/_manifest.json", "sha256": rollout.sha256}]
    forged = {"path": rollout.path, "sha256": "0" * 64}
    with pytest.raises(ChecksumMismatchError, match="0000000000"):
        _stage(layout, 0, "train", parents=[forged])


def test_stage_files_are_checked_against_the_manifest(layout: RunLayout) -> None:
    _stage(layout, 0, "train")
    assert json.loads(read_stage_file(layout, 0, "train", "metrics.json")) == {"stage": "train"}
    layout.store.write_bytes(layout.stage_file(0, "train", "metrics.json"), b'{"stage": "evil"}\n')
    with pytest.raises(ChecksumMismatchError, match="metrics.json"):
        read_stage_file(layout, 0, "train", "metrics.json")
    with pytest.raises(NotCommittedError, match="not listed"):
        read_stage_file(layout, 0, "train", "other.json")


def _iteration(layout: RunLayout, n: int, tmp_path: Path) -> None:
    rollout = _rollout(layout, n)
    teacher = _stage(layout, n, "teacher", parents=[rollout])
    _stage(layout, n, "train", parents=[teacher])
    weights = tmp_path / f"w{n}"
    weights.mkdir(exist_ok=True)
    (weights / "model.safetensors").write_bytes(b"w" * (n + 1))
    upload_checkpoint(weights, layout, n, "policy", parent="base", trained_on=[teacher])


def test_commit_iteration_names_every_part_then_moves_latest(layout: RunLayout, tmp_path: Path) -> None:
    assert read_latest(layout) is None
    _iteration(layout, 0, tmp_path)
    manifest = commit_iteration(layout, 0, metrics={"sdpo/loss": np.float32(0.25)}, timings={"rollout_s": 1.5})
    assert read_latest(layout) == 0 and iteration_committed(layout, 0)
    assert set(manifest.data["stages"]) == {"rollout", "teacher", "train"}
    assert manifest.data["stages"]["rollout"] == read_stage_manifest(layout, 0, "rollout").ref
    assert manifest.data["checkpoints"]["policy"]["path"] == "checkpoints/iter-0/policy/_manifest.json"
    assert manifest.data["previous"] is None and manifest.data["metrics"] == {"sdpo/loss": 0.25}
    pointer = json.loads(layout.store.read_bytes(layout.latest))
    assert pointer["sha256"] == manifest.sha256 and pointer["manifest"] == "iter-0/_manifest.json"
    _iteration(layout, 1, tmp_path)
    second = commit_iteration(layout, 1, metrics={})
    assert second.data["previous"] == manifest.ref and read_latest(layout) == 1
    assert commit_iteration(layout, 1, metrics={"ignored": 1}) == second  # idempotent
    with pytest.raises(AlreadyCommittedError, match="iteration 0 .* is committed but LATEST is 1"):
        commit_iteration(layout, 0, metrics={})


def test_iterations_commit_in_order_and_only_when_complete(layout: RunLayout, tmp_path: Path) -> None:
    _rollout(layout, 0)
    with pytest.raises(NotCommittedError, match="iter-0/teacher"):
        commit_iteration(layout, 0, metrics={})
    assert read_latest(layout) is None and not iteration_committed(layout, 0)
    _iteration(layout, 1, tmp_path)  # a run may number its first iteration 1 (iter-0 = base model)
    first = commit_iteration(layout, 1, metrics={})
    assert first.data["previous"] is None and read_latest(layout) == 1
    _iteration(layout, 3, tmp_path)
    with pytest.raises(ValueError, match="LATEST is 1, need 2"):
        commit_iteration(layout, 3, metrics={})
    _iteration(layout, 2, tmp_path)
    assert commit_iteration(layout, 2, metrics={}).data["previous"] == first.ref


def test_manifest_reads_like_its_content(layout: RunLayout) -> None:
    manifest = _rollout(layout, 0)
    assert manifest["metrics"] == {"rollout/reward_mean": 0.5} and manifest.get("absent") is None
    assert dict(manifest) == manifest.data and "files" in manifest


def test_interrupted_commit_is_finished_by_the_rerun(layout: RunLayout, tmp_path: Path) -> None:
    _iteration(layout, 0, tmp_path)
    manifest = commit_iteration(layout, 0, metrics={})
    layout.store.fs.rm_file(layout.store.path(layout.latest))  # died after the manifest, before LATEST
    again = commit_iteration(layout, 0, metrics={"ignored": 1})
    assert again == read_iteration_manifest(layout, 0) and again.sha256 == manifest.sha256
    assert read_latest(layout) == 0


def test_stage_without_files_commits_its_parents_and_metrics(layout: RunLayout, tmp_path: Path) -> None:
    teacher = _stage(layout, 0, "teacher")
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "model.safetensors").write_bytes(b"w")
    policy = upload_checkpoint(tmp_path / "w", layout, 0, "policy", parent=None, trained_on=[teacher])
    train = write_stage_manifest(layout, 0, "train", parents=[teacher, policy], metrics={"train/loss": 0.3})
    assert train["files"] == [] and train["parents"] == [teacher.ref, policy.ref]
    assert read_stage_manifest(layout, 0, "train") == train


def test_eval_metrics_are_committed_once_per_checkpoint(layout: RunLayout) -> None:
    assert read_eval(layout, 0) is None
    write_eval(layout, 0, {"eval/greedy_accuracy": 0.25})
    assert read_eval(layout, 0) == {"eval/greedy_accuracy": 0.25}
    assert json.loads(read_stage_file(layout, 0, "eval", "metrics.json")) == {"eval/greedy_accuracy": 0.25}
    with pytest.raises(AlreadyCommittedError):
        write_eval(layout, 0, {"eval/greedy_accuracy": 0.5})


def test_run_config_reads_back(layout: RunLayout) -> None:
    assert read_run_config(layout) == CONFIG


def test_manifest_metrics_must_be_finite_json_numbers() -> None:
    assert plain_metrics({"a": np.int64(3), "b": "x", "c": None}) == {"a": 3, "b": "x", "c": None}
    with pytest.raises(ValueError, match="'sdpo/loss' is nan"):
        plain_metrics({"sdpo/loss": float("nan")})
    with pytest.raises(TypeError, match="'t'"):
        plain_metrics({"t": [1, 2]})


def test_stage_needs_an_existing_run(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        StageOutput(RunLayout(str(tmp_path), "missing"), 0, "rollout")


def test_a_manifest_that_is_not_utf8_json_names_its_url(layout: RunLayout) -> None:
    from storage.errors import CorruptManifestError
    from storage.manifest import read_manifest

    manifest = _rollout(layout, 0)
    url = layout.url(manifest.path)
    for payload, message in [
        (b'{"a": "\xff"}', "is not UTF-8"),
        (b"{not json", "is not valid JSON"),
        (b"[1]", "a JSON list"),
    ]:
        layout.store.fs.pipe_file(layout.store.path(url), payload)
        with pytest.raises(CorruptManifestError, match=message) as err:
            read_manifest(layout, url)
        assert url in str(err.value)


def test_latest_is_verified_against_its_iteration_manifest(layout: RunLayout, tmp_path: Path) -> None:
    from storage.errors import ChecksumMismatchError, CorruptManifestError
    from storage.manifest import verify_latest

    assert verify_latest(layout) is None
    _iteration(layout, 0, tmp_path)
    commit_iteration(layout, 0, metrics={})
    assert verify_latest(layout) == 0
    pointer = json.loads(layout.store.read_bytes(layout.latest))
    layout.store.write_bytes(layout.latest, json.dumps({**pointer, "sha256": "0" * 64}).encode())
    with pytest.raises(ChecksumMismatchError, match="iter-0/_manifest.json"):
        verify_latest(layout)
    layout.store.write_bytes(layout.latest, json.dumps({**pointer, "iteration": "zero"}).encode())
    with pytest.raises(CorruptManifestError, match="field 'iteration' is 'zero'"):
        verify_latest(layout)
