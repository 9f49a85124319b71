"""Teacher shards store the teacher stage's columns alone; readers get the rollout's joined, checked.

The oracle of the joined read is the column dict a rollout + teacher pair was written from: every
column, in the order the teacher schema lists them (the rollout's, then the teacher's), with the
values written, whatever the shard and batch boundaries of either stage.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
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
    ShardJoinError,
    ShardSchema,
    ShardWriter,
    StageOutput,
    create_or_open_run,
    read_batches,
    read_stage_columns,
    read_stage_manifest,
    read_table,
    write_shards,
)
from storage.schemas import ROLLOUT_COLUMNS, STAGE_SCHEMAS, TEACHER_COLUMNS
from storage.synthetic import synthetic_columns

K = 4
ROLLOUT_ONLY = sorted(set(ROLLOUT.names) - {"sample_id"})


@pytest.fixture
def layout(tmp_path: Path) -> RunLayout:
    layout = RunLayout(str(tmp_path / "runs"), "run")
    create_or_open_run(layout, {"seed": 0})
    return layout


def _columns(rows: int = 45, *, first: int = 0) -> dict:
    return synthetic_columns(
        iteration=1, n_rows=rows, top_k=K, rng=np.random.default_rng(3), vocab=400, first_sample_id=first, teacher=True
    )


def _rollout(layout: RunLayout, columns: dict, **sizes: int):  # type: ignore[no-untyped-def]
    return write_shards(layout, 1, "rollout", {c: columns[c] for c in ROLLOUT.names}, **sizes).commit()


def _pair(layout: RunLayout, columns: dict) -> None:
    """Rollout shards of 20 rows, teacher shards of 16: the two stages' shard boundaries differ."""
    rollout = _rollout(layout, columns, rows_per_shard=20, row_group_size=6)
    teacher = {c: columns[c] for c in TEACHER.names}
    write_shards(layout, 1, "teacher", teacher, rows_per_shard=16, row_group_size=4).commit(parents=[rollout])


def _per_row(value: object) -> list:
    """Per-row values of a written column, as read_stage_columns returns them."""
    if isinstance(value, Ragged):
        return np.split(np.asarray(value.values), np.asarray(value.offsets)[1:-1])
    return list(value)  # type: ignore[call-overload]


def _flip_middle_byte(layout: RunLayout, url: str) -> None:
    data = bytearray(layout.store.read_bytes(url))
    data[len(data) // 2] ^= 0x01
    layout.store.write_bytes(url, bytes(data))


def test_teacher_shard_files_hold_no_rollout_column(layout: RunLayout) -> None:
    columns = _columns()
    _pair(layout, columns)
    files = read_stage_manifest(layout, 1, "teacher").data["files"]
    assert len(files) == 3
    for entry in files:
        stored = pq.ParquetFile(layout.store.path(layout.url(entry["path"]))).schema_arrow.names
        assert stored == ["sample_id"] + [c.name for c in TEACHER_COLUMNS if c.name != "sample_id"]
        assert not set(stored) & set(ROLLOUT_ONLY), set(stored) & set(ROLLOUT_ONLY)
        assert "prompt_ids" not in stored and "response_ids" not in stored and "reward" not in stored
    assert sum(f["response_tokens"] for f in files) == int(columns["response_ids"].offsets[-1])


def test_joined_read_returns_every_column_as_written(layout: RunLayout) -> None:
    columns = _columns()
    _pair(layout, columns)
    back = read_stage_columns(layout, 1, "teacher")
    expected_order = [c.name for c in ROLLOUT_COLUMNS] + [c.name for c in TEACHER_COLUMNS if c.name != "sample_id"]
    assert list(back) == expected_order == list(TEACHER.view_names)
    for name in expected_order:
        want, got = _per_row(columns[name]), back[name]
        assert len(got) == 45, name
        for i in range(45):
            if isinstance(want[i], np.ndarray):
                np.testing.assert_array_equal(got[i], want[i], err_msg=name)
            else:
                assert got[i] == want[i], (name, i)
    # the rollout's columns are the rollout stage's, value for value
    joined, rollout = read_table(layout, 1, "teacher"), read_table(layout, 1, "rollout")
    for name in ROLLOUT.names:
        assert joined.column(name).combine_chunks().equals(rollout.column(name).combine_chunks()), name


def test_joined_batches_follow_the_teacher_shards_and_carry_its_metadata(layout: RunLayout) -> None:
    _pair(layout, _columns())
    batches = list(read_batches(layout, 1, "teacher", columns=["reward", "teacher_entropy", "topk_ids"], batch_rows=5))
    assert [b.num_rows for b in batches] == [5, 5, 5, 1] * 2 + [5, 5, 3]  # teacher shards of 16, 16, 13 rows
    assert all(b.schema.names == ["reward", "teacher_entropy", "topk_ids"] for b in batches)
    assert batches[0].schema.metadata[b"sdpo.schema"] == b"teacher"
    assert batches[0].schema.metadata[b"sdpo.schema_version"] == b"3"
    rewards = np.concatenate([b.column("reward").to_numpy() for b in batches])
    np.testing.assert_array_equal(rewards, read_table(layout, 1, "rollout").column("reward").to_numpy())


def test_reading_teacher_columns_alone_leaves_the_rollout_unread(layout: RunLayout) -> None:
    _pair(layout, _columns())
    _flip_middle_byte(layout, layout.shard(1, "rollout", 0))
    own = read_table(layout, 1, "teacher", columns=["sample_id", "teacher_sampled_logprobs"])
    assert own.num_rows == 45
    with pytest.raises(ChecksumMismatchError):
        read_table(layout, 1, "teacher", columns=["sample_id", "response_ids"])


def test_a_tampered_rollout_shard_is_refused_naming_both_files(layout: RunLayout) -> None:
    _pair(layout, _columns())
    rollout_shard = layout.shard(1, "rollout", 1)  # rows 20-39: the 2nd and 3rd teacher shards join it
    _flip_middle_byte(layout, rollout_shard)
    with pytest.raises(ChecksumMismatchError) as refused:
        read_stage_columns(layout, 1, "teacher", columns=["sample_id", "prompt_ids", "teacher_topk_logprobs"])
    message = str(refused.value)
    assert rollout_shard in message and layout.shard(1, "teacher", 1) in message, message
    assert refused.value.url == rollout_shard and refused.value.needed_by == layout.shard(1, "teacher", 1)


def test_a_rollout_shard_of_other_samples_is_refused_naming_both_files(layout: RunLayout, tmp_path: Path) -> None:
    """A valid rollout shard of other samples in place of the one the teacher rows extend: refused by
    its digest, and, with the digests not checked, by its sample ids."""
    _pair(layout, _columns())
    other = RunLayout(str(tmp_path / "runs"), "other")
    create_or_open_run(other, {"seed": 0})
    _rollout(other, _columns(first=1000), rows_per_shard=20, row_group_size=6)
    rollout_shard = layout.shard(1, "rollout", 0)
    layout.store.write_bytes(rollout_shard, other.store.read_bytes(other.shard(1, "rollout", 0)))
    with pytest.raises(ChecksumMismatchError, match="read to join the rows of"):
        read_stage_columns(layout, 1, "teacher")
    with pytest.raises(ShardJoinError) as refused:
        read_stage_columns(layout, 1, "teacher", verify=False)
    message = str(refused.value)
    assert layout.shard(1, "teacher", 0) in message and rollout_shard in message, message
    assert "sample_id 0" in message and "sample_id 1000" in message


def test_a_rollout_stage_committed_again_is_refused_naming_both_manifests(layout: RunLayout) -> None:
    _pair(layout, _columns())
    layout.store.remove_tree(layout.stage_dir(1, "rollout"))
    _rollout(layout, _columns(44), rows_per_shard=20, row_group_size=6)
    with pytest.raises(ChecksumMismatchError) as refused:
        read_stage_columns(layout, 1, "teacher", verify=False)
    message = str(refused.value)
    assert layout.stage_manifest(1, "rollout") in message and layout.stage_manifest(1, "teacher") in message


@pytest.mark.parametrize("rows, match", [(43, "has more rows than"), (47, "holds rows beyond the last row of")])
def test_a_rollout_shard_of_other_length_is_refused_naming_both_files(layout, tmp_path, rows, match) -> None:  # type: ignore[no-untyped-def]
    """The last rollout shard (rows 40-44) swapped for one of 3 or 7 rows with the same first ids,
    the digests not checked: the row counts disagree."""
    _pair(layout, _columns())
    other = RunLayout(str(tmp_path / "runs"), "other")
    create_or_open_run(other, {"seed": 0})
    _rollout(other, _columns(rows), rows_per_shard=20, row_group_size=6)
    rollout_shard = layout.shard(1, "rollout", 2)
    layout.store.write_bytes(rollout_shard, other.store.read_bytes(other.shard(1, "rollout", 2)))
    with pytest.raises(ShardJoinError, match=match) as refused:
        read_stage_columns(layout, 1, "teacher", columns=["sample_id", "reward"], verify=False)
    message = str(refused.value)
    assert rollout_shard in message and layout.stage_dir(1, "teacher") in message, message


def test_the_writer_refuses_rows_that_are_not_the_rollout_rows_in_order(layout: RunLayout) -> None:
    columns = _columns(6)
    rollout = _rollout(layout, columns)
    teacher = {c: columns[c] for c in TEACHER.names}

    output = StageOutput(layout, 1, "teacher")
    reordered = {c: v for c, v in teacher.items()}
    reordered["sample_id"] = np.array([0, 2, 1, 3, 4, 5])
    with pytest.raises(ShardInvariantError, match="row 1 has sample_id 2, but row 1 of .* has 1"):
        with ShardWriter(output, TEACHER, top_k=K) as writer:
            writer.write(reordered)

    output = StageOutput(layout, 1, "teacher")
    writer = ShardWriter(output, TEACHER, top_k=K)
    writer.write(_slice(teacher, 0, 4))
    with pytest.raises(ShardInvariantError, match="4 rows written, but .*rollout/_manifest.json has 6 rows"):
        writer.close()
    writer.abort()

    output = StageOutput(layout, 1, "teacher")
    with ShardWriter(output, TEACHER, top_k=K) as writer:
        writer.write(_slice(teacher, 0, 4))
        writer.write(_slice(teacher, 4, 6))
    with pytest.raises(ValueError, match="name that manifest among the parents"):
        output.commit()
    assert output.commit(parents=[rollout]).data["rows"] == 6


def _slice(columns: dict, start: int, stop: int) -> dict:
    out = {}
    for name, value in columns.items():
        if isinstance(value, Ragged):
            out[name] = _per_row(value)[start:stop]
        else:
            out[name] = value[start:stop]
    return out


def test_the_writer_needs_the_committed_rollout_of_its_k(layout: RunLayout) -> None:
    with pytest.raises(NotCommittedError):
        ShardWriter(StageOutput(layout, 1, "teacher"), TEACHER, top_k=K)
    _rollout(layout, _columns(3))
    with pytest.raises(ValueError, match="K = 8 cannot extend .* \\(K = 4\\)"):
        ShardWriter(StageOutput(layout, 1, "teacher"), TEACHER, top_k=8)


def test_teacher_shards_of_schema_v2_are_refused_saying_what_to_do(layout: RunLayout, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A teacher stage written by the code before v3 (the rollout's columns repeated in its shards)."""
    columns = _columns(5)
    rollout = _rollout(layout, columns)
    v2 = ShardSchema("teacher", 2, ROLLOUT_COLUMNS + TEACHER_COLUMNS[1:])
    with monkeypatch.context() as patched:
        patched.setitem(STAGE_SCHEMAS, "teacher", v2)
        write_shards(layout, 1, "teacher", columns).commit(parents=[rollout])
    for read in (
        lambda: read_stage_columns(layout, 1, "teacher"),
        lambda: read_table(layout, 1, "teacher", columns=["sample_id"]),
    ):
        with pytest.raises(SchemaVersionError) as refused:
            read()
        message = str(refused.value)
        assert "iter-1/teacher/_manifest.json" in message and "written with teacher schema v2" in message
        assert "this code reads teacher schema v3" in message
        assert "read or resume that run with the code that wrote it" in message and "start a new run" in message
