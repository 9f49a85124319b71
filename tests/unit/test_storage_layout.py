"""URLs, run layout paths, and the frozen run config (memory:// and file://)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from storage import ConfigMismatchError, RunLayout, config_hash, create_or_open_run, read_run
from storage.urls import join, normalize, resolve


@pytest.fixture(params=["memory", "file"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "file":
        yield str(tmp_path / "runs")
        return
    url = f"memory://test-{uuid.uuid4().hex}"
    yield url
    memory = fsspec.filesystem("memory")
    if memory.exists(url):
        memory.rm(url, recursive=True)


CONFIG = {"model": {"name": "tiny", "lr": 1e-6}, "sdpo": {"top_k": 16, "alpha": 0.5}, "seeds": [1, 2]}


def test_plain_path_becomes_absolute_file_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert normalize("runs") == f"file://{tmp_path}/runs"
    assert normalize(f"file://{tmp_path}/x/") == f"file://{tmp_path}/x"
    fs, path = resolve("runs")
    assert isinstance(fs, LocalFileSystem) and path == f"{tmp_path}/runs"


def test_memory_and_s3_urls_normalise() -> None:
    assert normalize("memory://a/b/") == "memory:///a/b"
    assert normalize("s3://bucket/prefix/") == "s3://bucket/prefix"
    fs, path = resolve("memory://a/b")
    assert isinstance(fs, MemoryFileSystem) and path == "/a/b"


@pytest.mark.parametrize("url", ["gs://bucket/x", "http://host/x"])
def test_unsupported_scheme_is_refused_by_name(url: str) -> None:
    with pytest.raises(ValueError, match="unsupported storage URL"):
        normalize(url)


@pytest.mark.parametrize("part", ["..", "a/../b", "/abs", "", "a//b"])
def test_join_refuses_escaping_or_empty_parts(part: str) -> None:
    with pytest.raises(ValueError, match="bad path component"):
        join("memory://root", part)


def test_layout_builds_every_run_path(tmp_path: Path) -> None:
    layout = RunLayout(str(tmp_path), "exp-1")
    run = f"file://{tmp_path}/exp-1"
    assert layout.run_json == f"{run}/run.json"
    assert layout.latest == f"{run}/LATEST"
    assert layout.lock == f"{run}/LOCK"
    assert layout.stage_dir(3, "teacher") == f"{run}/iter-3/teacher"
    assert layout.stage_manifest(3, "rollout") == f"{run}/iter-3/rollout/_manifest.json"
    assert layout.shard(0, "rollout", 7) == f"{run}/iter-0/rollout/part-00007.parquet"
    assert layout.iteration_manifest(2) == f"{run}/iter-2/_manifest.json"
    assert layout.checkpoint_dir(4, "policy") == f"{run}/checkpoints/iter-4/policy"
    assert layout.checkpoint_manifest(4, "teacher") == f"{run}/checkpoints/iter-4/teacher/_manifest.json"
    assert layout.relative(layout.shard(1, "train", 0)) == "iter-1/train/part-00000.parquet"


@pytest.mark.parametrize(
    "bad",
    [
        lambda layout: layout.stage_dir(0, "score"),
        lambda layout: layout.checkpoint_dir(0, "critic"),
        lambda layout: layout.stage_dir(-1, "rollout"),
        lambda layout: layout.stage_file(0, "train", "_manifest.json"),
    ],
)
def test_layout_refuses_unknown_stage_kind_or_iteration(bad, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError):
        bad(RunLayout(str(tmp_path), "r"))


@pytest.mark.parametrize("name", ["", "a/b", "../x", "-x", "x y"])
def test_run_name_must_be_a_plain_name(name: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="run name"):
        RunLayout(str(tmp_path), name)


def test_local_dir_only_for_local_roots(tmp_path: Path) -> None:
    assert RunLayout(str(tmp_path), "r").local_dir == tmp_path / "r"
    assert RunLayout("memory://x", "r").local_dir is None


def test_layout_repr_hides_storage_options() -> None:
    layout = RunLayout("memory://x", "r", storage_options={"secret_marker": "hunter2"})
    assert "hunter2" not in repr(layout) and "hunter2" not in repr(layout.store)


def test_layouts_of_one_run_are_equal_whatever_their_stores() -> None:
    one, two = RunLayout("memory://x", "r"), RunLayout("memory://x", "r")
    assert one.store is not two.store
    assert one == two and hash(one) == hash(two)
    assert "ObjectStore" not in repr(one)
    assert RunLayout("memory://x", "other") != one


def test_run_config_is_frozen_at_creation(root: str) -> None:
    layout = RunLayout(root, "r")
    created = create_or_open_run(layout, CONFIG)
    assert created["config"] == CONFIG and created["config_hash"] == config_hash(CONFIG)
    stored = json.loads(layout.store.read_bytes(layout.run_json))
    assert stored["config"] == CONFIG and stored["run"] == "r"
    again = create_or_open_run(layout, json.loads(json.dumps(CONFIG)))
    assert again["created_at"] == created["created_at"]


def test_config_change_fails_and_lists_dotted_keys_old_to_new(root: str) -> None:
    layout = RunLayout(root, "r")
    create_or_open_run(layout, CONFIG)
    changed = {"model": {"name": "tiny", "lr": 2e-6}, "sdpo": {"top_k": 16}, "seeds": [1, 2], "new": True}
    with pytest.raises(ConfigMismatchError) as info:
        create_or_open_run(layout, changed)
    message = str(info.value)
    assert "model.lr: 1e-06 -> 2e-06" in message
    assert 'sdpo.alpha: 0.5 -> "<absent>"' in message
    assert 'new: "<absent>" -> true' in message
    assert "model.name" not in message
    assert read_run(layout)["config"] == CONFIG  # nothing recorded


def test_allowed_config_change_is_recorded_and_becomes_effective(root: str) -> None:
    layout = RunLayout(root, "r")
    create_or_open_run(layout, CONFIG)
    changed = {**CONFIG, "model": {"name": "tiny", "lr": 3e-6}}
    record = create_or_open_run(layout, changed, allow_config_change=True)
    assert record["config"] == changed and record["config_hash"] == config_hash(changed)
    lines = layout.store.read_bytes(layout.config_changes).decode().splitlines()
    assert len(lines) == 1
    change = json.loads(lines[0])
    assert change["diff"] == [{"key": "model.lr", "old": 1e-6, "new": 3e-6}]
    assert change["config_hash_old"] == config_hash(CONFIG) and change["changed_at"]
    assert create_or_open_run(layout, changed)["config_changes"] == 1  # same as effective: no new record
    assert json.loads(layout.store.read_bytes(layout.run_json))["config"] == CONFIG  # run.json stays frozen
    with pytest.raises(ConfigMismatchError, match="model.lr: 3e-06 -> 1e-06"):
        create_or_open_run(layout, CONFIG)


@pytest.mark.parametrize(
    "config, match",
    [
        ({"storage": {"storage_options": {"secret": "abc"}}}, "storage.storage_options"),
        ({"aws_secret_access_key": "abc"}, "aws_secret_access_key"),
        ({"a": {"b": object()}}, "a.b"),
        ({"a": [1, {2: 3}]}, "a\\[1\\]"),
    ],
)
def test_run_config_refuses_credentials_and_non_json_values(root: str, config: dict, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        create_or_open_run(RunLayout(root, "r"), config)


def test_read_run_of_missing_run_names_it(root: str) -> None:
    with pytest.raises(FileNotFoundError, match="run 'nope' does not exist"):
        read_run(RunLayout(root, "nope"))
