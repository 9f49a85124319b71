"""storage/ against a real S3 API (moto server on 127.0.0.1), including injected transient faults."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from storage import (
    ROLLOUT,
    TEACHER,
    AlreadyCommittedError,
    ChecksumMismatchError,
    LockHeldError,
    NotCommittedError,
    RetryPolicy,
    RunLayout,
    RunLock,
    ShardWriter,
    StageOutput,
    commit_iteration,
    create_or_open_run,
    download_checkpoint,
    lineage,
    read_latest,
    read_lock_holder,
    read_stage_manifest,
    read_table,
    resolve_checkpoint,
    stage_done,
    topk,
    upload_checkpoint,
)
from storage.hashing import sha256_bytes
from storage.synthetic import synthetic_columns

K = 16
CONFIG = {"model": "tiny", "lr": 1e-6}


@pytest.fixture
def layout(s3_root: str, s3_options: dict[str, Any]) -> RunLayout:
    layout = RunLayout(s3_root, "run", storage_options=s3_options)
    create_or_open_run(layout, CONFIG)
    return layout


def _columns(n: int, rows: int, *, first: int = 0, teacher: bool = False, seed: int = 0) -> dict:
    return synthetic_columns(
        iteration=n, n_rows=rows, top_k=K, rng=np.random.default_rng(seed), first_sample_id=first, teacher=teacher
    )


def _write_rollout(layout: RunLayout, n: int = 0, *, rows: int = 40, **kwargs: Any):  # type: ignore[no-untyped-def]
    output = StageOutput(layout, n, "rollout")
    columns = _columns(n, rows)
    with ShardWriter(output, ROLLOUT, top_k=K, rows_per_shard=16, row_group_size=8, **kwargs) as writer:
        writer.write(columns)
    return output.commit(), columns


def test_run_json_and_manifests_hold_no_credentials(layout: RunLayout, s3_options: dict[str, Any]) -> None:
    _write_rollout(layout)
    for url in layout.store.list_files(layout.run_url):
        if url.endswith(".json"):
            text = layout.store.read_bytes(url).decode()
            assert s3_options["secret"] not in text and s3_options["endpoint_url"] not in text


def test_parquet_round_trip_on_s3(layout: RunLayout) -> None:
    manifest, columns = _write_rollout(layout)
    assert [f["rows"] for f in manifest.data["files"]] == [16, 16, 8]
    for entry in manifest.data["files"]:
        assert sha256_bytes(layout.store.read_bytes(layout.url(entry["path"]))) == entry["sha256"]
    table = read_table(layout, 0, "rollout")
    ids, offsets = topk(table, "topk_ids")
    np.testing.assert_array_equal(ids, columns["topk_ids"].values)
    np.testing.assert_array_equal(offsets, columns["topk_ids"].offsets)
    np.testing.assert_array_equal(topk(table, "topk_logprobs").values, columns["topk_logprobs"].values)
    assert table.column("prompt_messages").to_pylist() == columns["prompt_messages"]
    unverified = read_table(layout, 0, "rollout", verify=False, columns=["sample_id", "reward"])
    np.testing.assert_array_equal(unverified.column("reward").to_numpy(), columns["reward"])


def test_teacher_shards_and_iteration_commit_on_s3(layout: RunLayout, tmp_path: Path) -> None:
    rollout, _ = _write_rollout(layout)
    teacher_out = StageOutput(layout, 0, "teacher")
    columns = _columns(0, 40, teacher=True)  # the rollout's rows (same seed), with teacher columns
    with ShardWriter(
        teacher_out, TEACHER, top_k=K, logprob_dtype="float16", rows_per_shard=32, row_group_size=8
    ) as writer:
        writer.write({c: columns[c] for c in TEACHER.names})
    teacher = teacher_out.commit(parents=[rollout])
    train = StageOutput(layout, 0, "train")
    train.write_json("metrics.json", {"sdpo/loss": 0.1})
    train.commit(parents=[teacher])
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "model.safetensors").write_bytes(b"weights")
    upload_checkpoint(tmp_path / "w", layout, 0, "policy", parent="base", trained_on=[teacher])
    manifest = commit_iteration(layout, 0, metrics={"sdpo/loss": 0.1})
    assert read_latest(layout) == 0
    assert manifest.data["stages"]["teacher"] == teacher.ref
    assert json.loads(layout.store.read_bytes(layout.latest))["sha256"] == manifest.sha256
    joined = read_table(layout, 0, "teacher")  # the rollout's columns joined from its 3 shards
    assert topk(joined, "teacher_topk_logprobs").values.dtype == np.float16
    np.testing.assert_array_equal(topk(joined, "topk_ids").values, columns["topk_ids"].values)


def test_flipped_byte_on_s3_is_detected(layout: RunLayout) -> None:
    manifest, _ = _write_rollout(layout)
    entry = manifest.data["files"][1]
    url = layout.url(entry["path"])
    data = bytearray(layout.store.read_bytes(url))
    data[100] ^= 0x04
    layout.store.write_bytes(url, bytes(data))
    with pytest.raises(ChecksumMismatchError) as info:
        read_table(layout, 0, "rollout")
    assert info.value.url == url and info.value.expected == entry["sha256"]
    assert info.value.actual == sha256_bytes(bytes(data))


def test_partial_write_on_s3_is_ignored_then_redone(layout: RunLayout) -> None:
    output = StageOutput(layout, 0, "rollout")
    with pytest.raises(RuntimeError), ShardWriter(output, ROLLOUT, top_k=K, rows_per_shard=8, row_group_size=4) as w:
        w.write(_columns(0, 20))
        raise RuntimeError("worker died")
    assert layout.store.list_files(layout.stage_dir(0, "rollout")) and not stage_done(layout, 0, "rollout")
    with pytest.raises(NotCommittedError):
        read_table(layout, 0, "rollout")
    manifest, _ = _write_rollout(layout, rows=5)
    assert read_table(layout, 0, "rollout").num_rows == 5
    assert len(layout.store.list_files(layout.stage_dir(0, "rollout"))) == len(manifest.data["files"]) + 1
    with pytest.raises(AlreadyCommittedError):
        StageOutput(layout, 0, "rollout")


def test_checkpoint_upload_download_and_cache_on_s3(layout: RunLayout, tmp_path: Path) -> None:
    source = tmp_path / "ckpt"
    (source / "iter_0000001" / "__0_0.distcp").parent.mkdir(parents=True)
    (source / "iter_0000001" / "__0_0.distcp").write_bytes(np.random.default_rng(0).bytes(200_000))
    (source / "iter_0000001" / ".metadata").write_bytes(b"meta")
    (source / "latest_checkpointed_iteration.txt").write_text("1")
    p0 = upload_checkpoint(source, layout, 0, "policy", parent="Qwen/Qwen3-0.6B")
    p1 = upload_checkpoint(source, layout, 1, "policy", parent=p0)
    local = download_checkpoint(layout, 1, "policy", cache_dir=tmp_path / "cache")
    assert local.name == p1.sha256
    for path in source.rglob("*"):
        if path.is_file():
            assert (local / path.relative_to(source)).read_bytes() == path.read_bytes()
    started = time.monotonic()
    assert download_checkpoint(layout, "iter-1", "policy", cache_dir=tmp_path / "cache") == local
    assert time.monotonic() - started < 5
    assert resolve_checkpoint(layout, 0).sha256 == p0.sha256
    assert [r.parent_ok for r in lineage(layout)] == [None, True]


def test_the_checkpoint_inventory_on_s3_lists_what_each_holds_and_its_bytes(layout: RunLayout, tmp_path: Path) -> None:
    """Retention's one listing (`RunLayout.checkpoint_inventory`) on S3, where a directory is a key prefix."""
    source = tmp_path / "ckpt"
    (source / "sub").mkdir(parents=True)
    (source / "sub" / "a.bin").write_bytes(b"a" * 300)
    (source / "b.bin").write_bytes(b"b" * 45)
    upload_checkpoint(source, layout, 0, "policy", parent="base")
    upload_checkpoint(source, layout, 2, "teacher", parent="base")
    layout.store.write_bytes(layout.checkpoint_tombstone(2, "teacher"), b"{}")
    inventory = layout.checkpoint_inventory()
    assert {key: (sorted(v.held), v.bytes) for key, v in inventory.items()} == {
        (0, "policy"): (["files", "manifest"], 345),
        (2, "teacher"): (["files", "manifest", "tombstone"], 345),
    }


def test_s3_honours_conditional_create(layout: RunLayout) -> None:
    url = layout.url("probe")
    layout.store.create_exclusive(url, b"first")
    with pytest.raises(FileExistsError):
        layout.store.create_exclusive(url, b"second")
    assert layout.store.read_bytes(url) == b"first"


def test_lock_contention_on_s3(s3_root: str, s3_options: dict[str, Any]) -> None:
    a = RunLayout(s3_root, "run", storage_options=s3_options)
    b = RunLayout(s3_root, "run", storage_options=dict(s3_options))  # another writer
    with RunLock(a, lease_seconds=60) as held:
        with pytest.raises(LockHeldError, match=f"pid={held.holder.pid}"):
            RunLock(b, lease_seconds=60).acquire()
        with pytest.raises(LockHeldError, match="locked by"):
            RunLock(b, lease_seconds=60, force=True).acquire()
    short = RunLock(a, lease_seconds=0.05)
    short.acquire()
    time.sleep(0.1)
    with pytest.raises(LockHeldError, match="lease expired"):
        RunLock(b, lease_seconds=60).acquire()
    with RunLock(b, lease_seconds=60, force=True) as thief:
        with pytest.raises(LockHeldError, match="lock lost"):
            short.renew()
        assert read_lock_holder(a) == thief.holder
    assert read_lock_holder(a) is None


# -- transient faults --------------------------------------------------------------------------
@pytest.fixture
def flaky_layout(s3_server: Any, s3_root: str, fault_proxy: Any) -> RunLayout:
    """A layout talking to moto through the fault proxy, botocore's own retries off."""
    options = s3_server.storage_options(
        fault_proxy.endpoint_url, retries={"total_max_attempts": 1}, read_timeout=0.2, connect_timeout=1
    )
    layout = RunLayout(
        s3_root, "run", storage_options=options, retry=RetryPolicy(attempts=4, backoff_s=0.01, max_backoff_s=0.05)
    )
    create_or_open_run(layout, CONFIG)
    return layout


def test_5xx_on_shard_upload_and_read_is_retried_by_our_wrapper(
    flaky_layout: RunLayout, fault_proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    fault_proxy.inject("503", method="PUT", path_contains="part-00000", times=2)
    fault_proxy.inject("500", method="GET", path_contains="part-00001", times=1)
    with caplog.at_level(logging.WARNING, logger="storage.retry"):
        manifest, columns = _write_rollout(flaky_layout, rows=20)
        table = read_table(flaky_layout, 0, "rollout")
    assert [kind for kind, _, _ in fault_proxy.injected] == ["503", "503", "500"]
    assert caplog.text.count("failed (attempt") == 3
    assert "part-00000.parquet failed (attempt 2/4)" in caplog.text and "unable to handle" in caplog.text
    assert "read s3://" in caplog.text and "part-00001.parquet failed (attempt 1/4)" in caplog.text
    np.testing.assert_array_equal(topk(table, "topk_ids").values, columns["topk_ids"].values)
    assert manifest.data["rows"] == 20


def test_5xx_on_conditional_manifest_put_is_retried(flaky_layout: RunLayout, fault_proxy: Any) -> None:
    fault_proxy.inject("503", method="PUT", path_contains="_manifest.json", times=2)
    output = StageOutput(flaky_layout, 0, "train")
    output.write_json("m.json", {})
    manifest = output.commit()
    assert len(fault_proxy.injected) == 2
    assert read_stage_manifest(flaky_layout, 0, "train").sha256 == manifest.sha256


def test_read_timeouts_are_retried(flaky_layout: RunLayout, fault_proxy: Any) -> None:
    url = flaky_layout.url("blob")
    flaky_layout.store.write_bytes(url, b"payload")
    fault_proxy.inject("timeout", method="GET", path_contains="/blob", times=2, stall_s=0.4)
    assert flaky_layout.store.read_bytes(url) == b"payload"
    assert len(fault_proxy.injected) == 2


def test_timeouts_beyond_s3fs_retries_are_retried_by_our_wrapper(
    flaky_layout: RunLayout, fault_proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    url = flaky_layout.url("blob")
    # s3fs retries a timed-out request 5 times itself; the 6th timeout reaches our wrapper.
    fault_proxy.inject("timeout", method="PUT", path_contains="/blob", times=6, stall_s=0.4)
    with caplog.at_level(logging.WARNING, logger="storage.retry"):
        flaky_layout.store.write_bytes(url, b"payload")
    assert len(fault_proxy.injected) == 6
    assert f"put {url} failed (attempt 1/4)" in caplog.text and "Timeout" in caplog.text
    assert flaky_layout.store.read_bytes(url) == b"payload"


def test_dropped_connections_during_checkpoint_upload_are_survived(
    flaky_layout: RunLayout, fault_proxy: Any, tmp_path: Path
) -> None:
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "model.safetensors").write_bytes(b"x" * 10_000)
    fault_proxy.inject("reset", method="PUT", path_contains="model.safetensors", times=2)
    upload_checkpoint(tmp_path / "w", flaky_layout, 0, "policy", parent=None)
    assert [k for k, _, _ in fault_proxy.injected] == ["reset", "reset"]
    local = download_checkpoint(flaky_layout, 0, "policy", cache_dir=tmp_path / "cache")
    assert (local / "model.safetensors").read_bytes() == b"x" * 10_000


def test_persistent_outage_fails_after_the_configured_attempts(flaky_layout: RunLayout, fault_proxy: Any) -> None:
    fault_proxy.inject("503", method="PUT", path_contains="/dead", times=100)
    with pytest.raises(OSError):
        flaky_layout.store.write_bytes(flaky_layout.url("dead"), b"x")
    assert len(fault_proxy.injected) == 4
