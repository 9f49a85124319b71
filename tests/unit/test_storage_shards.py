"""Parquet shards: exact round trips, invariants, bounded row groups, schema versions, checksums."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from storage import (
    ROLLOUT,
    TEACHER,
    ChecksumMismatchError,
    NotCommittedError,
    Ragged,
    RunLayout,
    SchemaVersionError,
    ShardInvariantError,
    ShardSchema,
    ShardWriter,
    StageOutput,
    create_or_open_run,
    ragged,
    read_batches,
    read_stage_columns,
    read_stage_manifest,
    read_table,
    topk,
    write_shards,
)
from storage.synthetic import synthetic_columns, synthetic_topk

K = 8


@pytest.fixture(params=["memory", "file"])
def layout(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RunLayout]:
    root = str(tmp_path / "runs") if request.param == "file" else f"memory://test-{uuid.uuid4().hex}"
    layout = RunLayout(root, "run")
    create_or_open_run(layout, {"seed": 0})
    yield layout
    memory = fsspec.filesystem("memory")
    if request.param == "memory" and memory.exists(root):
        memory.rm(root, recursive=True)


def _write(
    layout: RunLayout,
    batches: list[dict],
    *,
    stage: str = "rollout",
    schema: ShardSchema = ROLLOUT,
    n: int = 0,
    **writer_kwargs,
) -> None:  # type: ignore[no-untyped-def]
    output = StageOutput(layout, n, stage)
    with ShardWriter(output, schema, top_k=K, **writer_kwargs) as writer:
        for columns in batches:
            writer.write(columns)
    output.commit()


def _columns(n_rows: int, *, first: int = 0, teacher: bool = False, seed: int = 0) -> dict:
    return synthetic_columns(
        iteration=0,
        n_rows=n_rows,
        top_k=K,
        rng=np.random.default_rng(seed),
        first_sample_id=first,
        teacher=teacher,
        vocab=1000,
    )


def _drop_last_token(value: Ragged) -> Ragged:
    """The same rows with the very last token missing (the last row is one short)."""
    return Ragged(value.values[:-1], np.minimum(value.offsets, len(value.values) - 1))


def _flat(value: Ragged) -> np.ndarray:
    return np.asarray(value.values)


def test_rollout_round_trip_is_exact_as_numpy(layout: RunLayout) -> None:
    a, b = _columns(30, seed=1), _columns(25, first=30, seed=2)
    _write(layout, [a, b], rows_per_shard=20, row_group_size=8)
    table = read_table(layout, 0, "rollout")
    assert table.num_rows == 55
    ids, offsets = topk(table, "topk_ids")
    assert ids.shape == (a["topk_ids"].values.shape[0] + b["topk_ids"].values.shape[0], K)
    np.testing.assert_array_equal(ids, np.concatenate([a["topk_ids"].values, b["topk_ids"].values]))
    lp, lp_offsets = topk(table, "topk_logprobs")
    np.testing.assert_array_equal(lp, np.concatenate([a["topk_logprobs"].values, b["topk_logprobs"].values]))
    response = ragged(table, "response_ids")
    np.testing.assert_array_equal(np.diff(response.offsets), np.diff(offsets))
    np.testing.assert_array_equal(lp_offsets, offsets)
    np.testing.assert_array_equal(response.values, np.concatenate([_flat(a["response_ids"]), _flat(b["response_ids"])]))
    assert table.column("prompt_messages").to_pylist() == a["prompt_messages"] + b["prompt_messages"]
    assert table.column("feedback").to_pylist() == a["feedback"] + b["feedback"]
    assert table.column("teacher_prompt").to_pylist() == [None] * 55
    np.testing.assert_array_equal(table.column("sample_id").to_numpy(), np.arange(55))


def _write_pair(layout: RunLayout, columns: dict, **teacher_kwargs) -> None:  # type: ignore[no-untyped-def]
    """The rollout stage and the teacher stage extending its rows, from one synthetic teacher column dict."""
    rollout = write_shards(layout, 0, "rollout", {c: columns[c] for c in ROLLOUT.names}).commit()
    output = StageOutput(layout, 0, "teacher")
    with ShardWriter(output, TEACHER, top_k=K, **teacher_kwargs) as writer:
        writer.write({c: columns[c] for c in TEACHER.names})
    output.commit(parents=[rollout])


def test_teacher_round_trip_with_float16_logprobs(layout: RunLayout) -> None:
    columns = _columns(12, teacher=True)
    _write_pair(layout, columns, logprob_dtype="float16")
    (batch,) = list(read_batches(layout, 0, "teacher"))
    values, _ = topk(batch, "teacher_topk_logprobs")
    assert values.dtype == np.float16
    np.testing.assert_array_equal(values, columns["teacher_topk_logprobs"].values.astype(np.float16))
    sampled = ragged(batch, "teacher_sampled_logprobs")
    assert sampled.values.dtype == np.float32  # sampled-token logprobs stay float32
    np.testing.assert_array_equal(sampled.values, columns["teacher_sampled_logprobs"].values)
    np.testing.assert_array_equal(batch.column("sample_mask").to_numpy(zero_copy_only=False), columns["sample_mask"])
    entropy = ragged(batch, "teacher_entropy")
    assert entropy.values.dtype == np.float32  # entropies stay float32 too
    np.testing.assert_array_equal(entropy.values, columns["teacher_entropy"].values)
    np.testing.assert_array_equal(entropy.offsets, columns["teacher_entropy"].offsets)
    assert batch.column("route").to_pylist() == [None] * 12
    np.testing.assert_array_equal(batch.column("pass_rate").to_numpy(), columns["pass_rate"])
    assert read_stage_manifest(layout, 0, "teacher").data["schema"] == {
        "name": "teacher",
        "version": 3,
        "top_k": K,
        "logprob_dtype": "float16",
        "topk_layout": "list<fixed_size_list<K>>",
        "extends": read_stage_manifest(layout, 0, "rollout").ref,
    }


def test_write_shards_and_read_stage_columns_round_trip_per_row(layout: RunLayout) -> None:
    columns = _columns(7, teacher=True)
    rollout = write_shards(layout, 0, "rollout", {c: columns[c] for c in ROLLOUT.names}).commit()
    teacher = {c: columns[c] for c in TEACHER.names}
    manifest = write_shards(layout, 0, "teacher", teacher).commit(parents=[rollout], metrics={"teacher/x": 1.0})
    assert manifest["schema"]["top_k"] == K and manifest["metrics"] == {"teacher/x": 1.0}
    back = read_stage_columns(layout, 0, "teacher")
    assert list(back) == list(TEACHER.view_names)
    values, offsets = columns["topk_logprobs"]
    for i in range(7):
        np.testing.assert_array_equal(back["topk_logprobs"][i], values[offsets[i] : offsets[i + 1]])
        assert back["topk_ids"][i].shape == (offsets[i + 1] - offsets[i], K)
        assert len(back["teacher_sampled_logprobs"][i]) == offsets[i + 1] - offsets[i]
    np.testing.assert_array_equal(back["reward"], columns["reward"])
    np.testing.assert_array_equal(back["advantage"], columns["advantage"])
    assert back["prompt_messages"] == columns["prompt_messages"] and back["feedback"] == columns["feedback"]
    some = read_stage_columns(layout, 0, "teacher", columns=["sample_id", "response_ids"])
    assert set(some) == {"sample_id", "response_ids"}


def test_write_shards_infers_k_or_needs_it_for_no_rows(layout: RunLayout) -> None:
    empty = {name: [] for name in ROLLOUT.names}
    with pytest.raises(ValueError, match="pass top_k"):
        write_shards(layout, 0, "rollout", empty)
    assert write_shards(layout, 0, "rollout", empty, top_k=K).commit()["rows"] == 0
    assert read_stage_columns(layout, 0, "rollout")["topk_ids"] == []
    with pytest.raises(ValueError, match="not 'train'"):
        write_shards(layout, 0, "train", _columns(2))


def test_python_lists_and_ragged_inputs_are_equivalent(layout: RunLayout) -> None:
    columns = _columns(5)
    as_lists = dict(columns)
    for name in ("prompt_ids", "response_ids", "sampled_logprobs", "topk_ids", "topk_logprobs"):
        values, offsets = columns[name]
        as_lists[name] = [values[offsets[i] : offsets[i + 1]].tolist() for i in range(5)]
    as_lists["sample_id"] = list(range(5, 10))
    _write(layout, [columns, as_lists])
    table = read_table(layout, 0, "rollout")
    first, second = table.slice(0, 5), table.slice(5, 5)
    for name in ("prompt_ids", "response_ids", "sampled_logprobs", "topk_ids", "topk_logprobs"):
        assert first.column(name).to_pylist() == second.column(name).to_pylist()


def test_helpers_handle_sliced_batches_without_copying_rows(layout: RunLayout) -> None:
    columns = _columns(10)
    _write(layout, [columns])
    table = read_table(layout, 0, "rollout").slice(3, 4)
    ids, offsets = topk(table, "topk_ids")
    values, src_offsets = columns["topk_ids"]
    np.testing.assert_array_equal(ids, values[src_offsets[3] : src_offsets[7]])
    np.testing.assert_array_equal(offsets, src_offsets[3:8] - src_offsets[3])


def test_row_groups_and_shards_are_bounded(layout: RunLayout) -> None:
    _write(layout, [_columns(7, first=i * 7, seed=i) for i in range(10)], rows_per_shard=24, row_group_size=10)
    manifest = read_stage_manifest(layout, 0, "rollout")
    assert [f["rows"] for f in manifest.data["files"]] == [24, 24, 22]
    for entry in manifest.data["files"]:
        with layout.store.open_read(layout.url(entry["path"])) as f:
            metadata = pq.ParquetFile(f).metadata
        sizes = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
        assert max(sizes) <= 10 and sum(sizes) == entry["rows"]


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda c: c.update(sampled_logprobs=_drop_last_token(c["sampled_logprobs"])), "len\\(sampled_logprobs\\)"),
        (
            lambda c: c.update(topk_ids=Ragged(c["topk_ids"].values[:, :4], c["topk_ids"].offsets)),
            "must be \\[N_tokens, 8\\]",
        ),
        (lambda c: c.update(finish_reason=["stop"] * 3 + ["abort"]), "finish_reason 'abort'"),
        (lambda c: c.update(iteration=np.full(4, 2, np.int32)), "iteration is 2"),
        (lambda c: c.update(sample_id=np.array([0, 1, 1, 2])), "duplicate sample_id"),
        (lambda c: c.pop("label"), "missing columns \\['label'\\]"),
        (lambda c: c.update(bogus=[1, 2, 3, 4]), "unknown columns \\['bogus'\\]"),
        (lambda c: c.update(reward=np.ones(3, np.float32)), "different row counts"),
        (lambda c: c.update(label=[None, "1", "2", "3"]), "null in non-nullable column 'label'"),
        (lambda c: c.update(prompt_messages=[[{"role": "user", "content": "x", "name": "n"}]] * 4), "role', 'content'"),
        (lambda c: c["topk_logprobs"].values.__setitem__((0, 0), np.nan), "'topk_logprobs' holds NaN"),
        (lambda c: c["sampled_logprobs"].values.__setitem__(0, 0.5), "'sampled_logprobs' holds NaN or a value > "),
        (lambda c: c["response_ids"].values.__setitem__(0, -3), "negative value -3 in 'response_ids'"),
        (lambda c: c["reward"].__setitem__(1, np.inf), "'reward' is not finite"),
    ],
)
def test_writer_rejects_rows_breaking_invariants(layout: RunLayout, mutate, match: str) -> None:  # type: ignore
    columns = _columns(4)
    mutate(columns)
    output = StageOutput(layout, 0, "rollout")
    with pytest.raises(ShardInvariantError, match=match), ShardWriter(output, ROLLOUT, top_k=K) as writer:
        writer.write(columns)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda c: c.update(teacher_entropy=_drop_last_token(c["teacher_entropy"])), "len\\(teacher_entropy\\)"),
        (
            lambda c: c["teacher_entropy"].values.__setitem__(2, -0.01),
            "'teacher_entropy' holds a non-finite value or one <",
        ),
        (lambda c: c["teacher_entropy"].values.__setitem__(0, np.nan), "'teacher_entropy' holds a non-finite value"),
        (lambda c: c.update(route=["sdpo", None, "blend", "grpo"]), "route 'blend' not in \\('sdpo', 'grpo'\\)"),
        (lambda c: c.update(pass_rate=np.array([0.5, 1.25, 0.0, 0.5], np.float32)), "pass_rate 1.25 is outside"),
        (lambda c: c.update(pass_rate=np.array([0.5, np.nan, 0.0, 0.5], np.float32)), "'pass_rate' is not finite"),
    ],
)
def test_teacher_writer_rejects_bad_routes_pass_rates_and_entropies(layout: RunLayout, mutate, match: str) -> None:  # type: ignore
    columns = _columns(4, teacher=True)
    write_shards(layout, 0, "rollout", {c: columns[c] for c in ROLLOUT.names}).commit()
    columns["route"] = ["sdpo", "grpo", None, "grpo"]
    mutate(columns)
    output = StageOutput(layout, 0, "teacher")
    with pytest.raises(ShardInvariantError, match=match), ShardWriter(output, TEACHER, top_k=K) as writer:
        writer.write({c: columns[c] for c in TEACHER.names})


def test_sample_ids_must_be_unique_across_batches(layout: RunLayout) -> None:
    output = StageOutput(layout, 0, "rollout")
    writer = ShardWriter(output, ROLLOUT, top_k=K)
    writer.write(_columns(4))
    with pytest.raises(ShardInvariantError, match="duplicate sample_id"):
        writer.write(_columns(4))


def test_stage_shards_must_use_the_stage_schema(layout: RunLayout) -> None:
    with pytest.raises(ValueError, match="stage 'rollout' holds rollout shards, not teacher"):
        ShardWriter(StageOutput(layout, 0, "rollout"), TEACHER, top_k=K)


def test_reading_another_schema_version_names_both_versions(layout: RunLayout) -> None:
    future = ShardSchema("rollout", 2, ROLLOUT.columns)
    output = StageOutput(layout, 0, "eval")
    with ShardWriter(output, future, top_k=K) as writer:
        writer.write(_columns(3))
    output.commit()
    with pytest.raises(SchemaVersionError, match="written with rollout schema v2; this code reads rollout schema v1"):
        next(read_batches(layout, 0, "eval"))


def test_file_claiming_a_version_is_checked_against_its_columns(layout: RunLayout) -> None:
    output = StageOutput(layout, 0, "eval")
    with ShardWriter(output, ROLLOUT, top_k=K) as writer:
        writer.write(_columns(3))
    output.commit()
    other = ShardSchema("rollout", 1, ROLLOUT.columns[:-1])
    with pytest.raises(SchemaVersionError, match="its columns differ"):
        next(read_batches(layout, 0, "eval", schema=other))


def test_flipped_byte_is_detected_naming_file_and_digests(layout: RunLayout) -> None:
    _write(layout, [_columns(6)])
    entry = read_stage_manifest(layout, 0, "rollout").data["files"][0]
    url = layout.url(entry["path"])
    data = bytearray(layout.store.read_bytes(url))
    data[len(data) // 2] ^= 0x01
    layout.store.write_bytes(url, bytes(data))
    with pytest.raises(ChecksumMismatchError) as info:
        list(read_batches(layout, 0, "rollout"))
    assert url in str(info.value) and entry["sha256"] in str(info.value)
    assert info.value.actual != entry["sha256"]


def test_verification_can_be_switched_off(layout: RunLayout) -> None:
    _write(layout, [_columns(6, seed=1)])
    _write(layout, [_columns(6, seed=2)], stage="eval")
    rollout = layout.url(read_stage_manifest(layout, 0, "rollout").data["files"][0]["path"])
    other = layout.url(read_stage_manifest(layout, 0, "eval").data["files"][0]["path"])
    layout.store.write_bytes(rollout, layout.store.read_bytes(other))  # valid Parquet, wrong content
    with pytest.raises(ChecksumMismatchError):
        list(read_batches(layout, 0, "rollout"))
    unchecked = read_table(layout, 0, "rollout", verify=False)
    assert unchecked.equals(read_table(layout, 0, "eval"))


def test_empty_stage_commits_and_reads_as_empty_table(layout: RunLayout) -> None:
    output = StageOutput(layout, 0, "rollout")
    with ShardWriter(output, ROLLOUT, top_k=K):
        pass
    manifest = output.commit()
    assert manifest.data["files"] == [] and manifest.data["rows"] == 0
    table = read_table(layout, 0, "rollout")
    assert table.num_rows == 0 and table.schema.names == list(ROLLOUT.names)


def test_stage_with_open_writer_cannot_commit(layout: RunLayout) -> None:
    output = StageOutput(layout, 0, "rollout")
    writer = ShardWriter(output, ROLLOUT, top_k=K)
    writer.write(_columns(2))
    with pytest.raises(ValueError, match="close the shard writer"):
        output.commit()
    writer.close()
    assert output.commit().data["rows"] == 2


def test_uncommitted_stage_cannot_be_read(layout: RunLayout) -> None:
    output = StageOutput(layout, 0, "rollout")
    with ShardWriter(output, ROLLOUT, top_k=K) as writer:
        writer.write(_columns(3))
    with pytest.raises(NotCommittedError, match="not committed"):
        next(read_batches(layout, 0, "rollout"))


def test_column_projection_returns_only_those_columns(layout: RunLayout) -> None:
    _write(layout, [_columns(6)])
    batch = next(read_batches(layout, 0, "rollout", columns=["topk_ids", "reward"]))
    assert batch.schema.names == ["topk_ids", "reward"]
    assert topk(batch, "topk_ids").values.shape[1] == K


def test_topk_refuses_a_column_that_is_not_top_k() -> None:
    batch = pa.record_batch({"response_ids": pa.array([[1, 2]], pa.list_(pa.int32()))})
    with pytest.raises(SchemaVersionError, match="not a top-K"):
        topk(batch, "response_ids")


def test_topk_columns_carry_k_in_type_and_metadata(layout: RunLayout) -> None:
    _write(layout, [_columns(3)])
    batch = next(read_batches(layout, 0, "rollout"))
    assert batch.schema.field("topk_logprobs").type.value_type.list_size == K
    assert batch.schema.metadata[b"sdpo.top_k"] == str(K).encode()
    assert batch.schema.metadata[b"sdpo.schema_version"] == b"1"


def test_topk_columns_fit_100_bytes_per_token_at_k16(tmp_path: Path) -> None:
    """Realistic top-16 rows (Zipf ids over a Qwen-size vocab, peaked logprobs) stay under budget."""
    layout = RunLayout(str(tmp_path), "run")
    create_or_open_run(layout, {})
    rng = np.random.default_rng(0)
    output = StageOutput(layout, 0, "rollout")
    with ShardWriter(output, ROLLOUT, top_k=16, row_group_size=64) as writer:
        writer.write(synthetic_columns(iteration=0, n_rows=128, top_k=16, rng=rng, response_len=(256, 256)))
    (entry,) = output.commit().data["files"]
    per_token = (entry["column_bytes"]["topk_ids"] + entry["column_bytes"]["topk_logprobs"]) / entry["response_tokens"]
    assert entry["response_tokens"] == 128 * 256
    assert per_token <= 100, per_token


def test_synthetic_topk_is_realistic_not_uniform() -> None:
    ids, logprobs = synthetic_topk(20_000, 16, vocab=151_936, rng=np.random.default_rng(0))
    assert np.all(np.diff(logprobs, axis=1) <= 0)  # sorted descending
    assert np.all(np.sort(ids, axis=1)[:, 1:] != np.sort(ids, axis=1)[:, :-1])  # distinct per token
    top1 = np.exp(logprobs[:, 0])
    assert 0.6 < np.median(top1) < 0.95
    mass = np.exp(logprobs.astype(np.float64)).sum(axis=1)
    assert np.all(mass <= 1.0 + 1e-6) and mass.mean() < 0.999  # some mass outside the top K
    assert np.median(ids) < 151_936 / 10  # frequent (low) ids dominate
