"""Random row access to committed stages: positions from read_index, rows from read_rows."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from storage.errors import ShardJoinError
from storage.layout import RunLayout, create_or_open_run
from storage.lookup import ROW_COLUMN, SHARD_COLUMN, read_index, read_rows
from storage.schemas import ROLLOUT, TEACHER
from storage.shard_reader import read_stage_columns
from storage.shard_writer import write_shards
from storage.synthetic import synthetic_columns

K = 4


@pytest.fixture
def layout(tmp_path) -> RunLayout:
    layout = RunLayout(str(tmp_path), "run")
    create_or_open_run(layout, {"model": "tiny"})
    columns = synthetic_columns(
        iteration=1, n_rows=50, top_k=K, rng=np.random.default_rng(0), vocab=300, first_sample_id=100, teacher=True
    )
    # the rollout in 3 shards of 20 rows, the teacher rows extending them in 4 shards of 16 (4-row groups)
    rollout = write_shards(
        layout, 1, "rollout", {c: columns[c] for c in ROLLOUT.names}, rows_per_shard=20, row_group_size=5
    ).commit()
    teacher = {c: columns[c] for c in TEACHER.names}
    write_shards(layout, 1, "teacher", teacher, rows_per_shard=16, row_group_size=4).commit(parents=[rollout])
    return layout


def test_read_index_gives_every_row_its_shard_and_row(layout):
    index = read_index(layout, 1, "teacher", columns=["sample_id", "reward"])
    assert index.column_names == ["sample_id", "reward", SHARD_COLUMN, ROW_COLUMN]
    assert index.column("sample_id").to_pylist() == list(range(100, 150))
    assert index.column(SHARD_COLUMN).to_pylist() == [i // 16 for i in range(50)]
    assert index.column(ROW_COLUMN).to_pylist() == [i % 16 for i in range(50)]


def test_read_rows_returns_exactly_the_rows_asked_for_in_that_order(layout):
    full = read_stage_columns(layout, 1, "teacher")
    index = read_index(layout, 1, "teacher", columns=["sample_id"])
    wanted = [49, 0, 17, 18, 31, 3]  # across shards and row groups, out of order
    positions = [(index.column(SHARD_COLUMN)[i].as_py(), index.column(ROW_COLUMN)[i].as_py()) for i in wanted]
    rows = read_rows(layout, 1, "teacher", positions, columns=["sample_id", "teacher_sampled_logprobs", "topk_ids"])
    assert rows.column("sample_id").to_pylist() == [100 + i for i in wanted]
    for j, i in enumerate(wanted):
        np.testing.assert_array_equal(
            rows.column("teacher_sampled_logprobs")[j].as_py(), full["teacher_sampled_logprobs"][i]
        )
        np.testing.assert_array_equal(np.array(rows.column("topk_ids")[j].as_py()), full["topk_ids"][i])


def test_read_rows_of_nothing_is_an_empty_table_with_the_columns(layout):
    rows = read_rows(layout, 1, "teacher", [], columns=["sample_id", "reward"])
    assert rows.num_rows == 0 and rows.column_names == ["sample_id", "reward"]
    assert isinstance(rows, pa.Table)


@pytest.mark.parametrize("position", [(4, 0), (0, 16), (-1, 0)])
def test_positions_outside_the_stage_fail_with_the_sizes(layout, position):
    with pytest.raises(IndexError, match="shard|rows"):
        read_rows(layout, 1, "teacher", [position])


def test_read_index_checks_the_shards_digest(layout):
    manifest_path = layout.stage_dir(1, "teacher") + "/part-00001.parquet"
    path = layout.store.path(manifest_path)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    from storage.errors import ChecksumMismatchError

    with pytest.raises(ChecksumMismatchError):
        read_index(layout, 1, "teacher", columns=["sample_id"])


def test_joined_rows_are_the_rollout_rows_at_the_same_stage_position(layout):
    """Teacher positions map to rollout rows in other shards (20-row rollout shards, 16-row teacher
    shards): every column of the index and of single rows equals the whole-stage read."""
    full = read_stage_columns(layout, 1, "teacher")
    index = read_index(layout, 1, "teacher", columns=["reward", "teacher_source", "response_text"])
    assert index.column("reward").to_numpy().tolist() == full["reward"].tolist()
    assert index.column("response_text").to_pylist() == full["response_text"]
    wanted = [19, 20, 47, 0, 33]
    positions = [(index.column(SHARD_COLUMN)[i].as_py(), index.column(ROW_COLUMN)[i].as_py()) for i in wanted]
    rows = read_rows(layout, 1, "teacher", positions)
    assert rows.column_names == list(TEACHER.view_names)
    assert rows.column("prompt_messages").to_pylist() == [full["prompt_messages"][i] for i in wanted]
    for j, i in enumerate(wanted):
        np.testing.assert_array_equal(rows.column("response_ids")[j].as_py(), full["response_ids"][i])
        np.testing.assert_array_equal(rows.column("teacher_entropy")[j].as_py(), full["teacher_entropy"][i])


def test_read_rows_refuses_a_rollout_row_of_another_sample(layout, tmp_path):
    """A rollout shard swapped for one of other samples (the digests not checked, as the viewer reads
    single rows): the row is refused naming both shards."""
    other = RunLayout(str(tmp_path), "other")
    create_or_open_run(other, {"model": "tiny"})
    columns = synthetic_columns(
        iteration=1, n_rows=50, top_k=K, rng=np.random.default_rng(0), vocab=300, first_sample_id=500
    )
    write_shards(other, 1, "rollout", columns, rows_per_shard=20, row_group_size=5).commit()
    swapped = other.store.read_bytes(other.shard(1, "rollout", 1))
    layout.store.write_bytes(layout.shard(1, "rollout", 1), swapped)
    assert read_rows(layout, 1, "teacher", [(0, 3)], columns=["reward"]).num_rows == 1  # rollout shard 0: intact
    with pytest.raises(ShardJoinError) as refused:
        read_rows(layout, 1, "teacher", [(1, 5)], columns=["sample_id", "reward"])  # stage row 21: rollout shard 1
    message = str(refused.value)
    assert layout.shard(1, "teacher", 1) in message and layout.shard(1, "rollout", 1) in message
    assert "sample_id 121" in message and "sample_id 521" in message
