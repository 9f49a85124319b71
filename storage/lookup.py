"""Random access to rows of a committed shard stage: an index of positions, then single rows.

A reader that shows one sample at a time (the viewer) should not stream a whole stage per request.
`read_index` reads the named columns of every row once (each shard sha256-checked), adding each
row's position: `_shard` (index into the manifest's shard list) and `_row` (row within that shard).
`read_rows` then reads just the row groups holding the requested positions. A stage that extends
another's rows (the teacher's) is read joined, as `storage.shard_reader` does, its positions being
those of its own shards; the rows it extends are found by their position in the stage and checked
by `sample_id`.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from storage.layout import RunLayout
from storage.manifest import Manifest, read_stage_manifest
from storage.schemas import JOIN_KEY, ShardSchema, check_shard_schema
from storage.shard_reader import (
    check_keys,
    empty_table,
    expected_schema,
    extended_stage,
    open_shard,
    read_table,
    shard_entries,
)

SHARD_COLUMN = "_shard"
ROW_COLUMN = "_row"


def read_index(layout: RunLayout, n: int, stage: str, *, columns: Sequence[str], verify: bool = True) -> pa.Table:
    """`columns` of every row of a committed stage, plus `_shard` and `_row` (int32) positions."""
    manifest = read_stage_manifest(layout, n, stage)
    expected = expected_schema(manifest, None)
    if expected.extends is not None:
        table = read_table(layout, n, stage, columns=columns, verify=verify)
        counts = [int(e["rows"]) for e in shard_entries(manifest)]
        shards = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
        rows = np.concatenate([np.zeros(0, np.int32), *(np.arange(c, dtype=np.int32) for c in counts)])
        table = table.append_column(SHARD_COLUMN, pa.array(shards))
        return table.append_column(ROW_COLUMN, pa.array(rows))
    tables = []
    for index, entry in enumerate(shard_entries(manifest)):
        parquet = open_shard(layout, entry, verify=verify)
        check_shard_schema(expected, parquet.schema_arrow, where=layout.url(entry["path"]))
        table = parquet.read(columns=list(columns))
        parquet.close()
        rows = table.num_rows
        table = table.append_column(SHARD_COLUMN, pa.array(np.full(rows, index, dtype=np.int32)))
        tables.append(table.append_column(ROW_COLUMN, pa.array(np.arange(rows, dtype=np.int32))))
    if not tables:
        empty = empty_table(layout, manifest, expected, columns)
        empty = empty.append_column(SHARD_COLUMN, pa.array([], type=pa.int32()))
        return empty.append_column(ROW_COLUMN, pa.array([], type=pa.int32()))
    return pa.concat_tables(tables)


def read_rows(
    layout: RunLayout,
    n: int,
    stage: str,
    positions: Sequence[tuple[int, int]],
    *,
    columns: Sequence[str] | None = None,
    verify: bool = False,
) -> pa.Table:
    """The rows at `positions` [(shard, row)] of a committed stage, in the order given.

    Only the row groups holding them are read. `verify` sha256-checks each shard touched (the whole
    file is read for that); committed shards are immutable, so a reader that verified them in
    `read_index` can skip it here.
    """
    manifest = read_stage_manifest(layout, n, stage)
    expected = expected_schema(manifest, None)
    if expected.extends is None:
        return _rows_at(layout, manifest, expected, positions, columns=columns, verify=verify)
    wanted = list(columns) if columns else list(expected.view_names)
    own = [c for c in wanted if c in expected.names]
    other = [c for c in wanted if c not in expected.names]
    for name in other:
        expected.column(name)  # a KeyError naming the columns there are
    if not positions:
        return empty_table(layout, manifest, expected, wanted)
    own_read = own if JOIN_KEY in own else [*own, JOIN_KEY]
    own_rows = _rows_at(layout, manifest, expected, positions, columns=own_read, verify=verify)
    if not other:
        return own_rows.select(own)
    extended, extended_schema = extended_stage(layout, manifest, expected)
    own_entries, their_entries = shard_entries(manifest), shard_entries(extended)
    own_starts = np.cumsum([0] + [int(e["rows"]) for e in own_entries])
    their_starts = np.cumsum([0] + [int(e["rows"]) for e in their_entries])
    stage_rows = np.array([own_starts[shard] + row for shard, row in positions], dtype=np.int64)
    their_shards = np.searchsorted(their_starts, stage_rows, side="right") - 1
    their_positions = [(int(s), int(r - their_starts[s])) for s, r in zip(their_shards, stage_rows, strict=True)]
    their_rows = _rows_at(
        layout,
        extended,
        extended_schema,
        their_positions,
        columns=[*other, JOIN_KEY],
        verify=verify,
        needed_by=layout.url(manifest.path),
    )
    own_keys, their_keys = own_rows.column(JOIN_KEY).to_numpy(), their_rows.column(JOIN_KEY).to_numpy()
    if (bad := np.flatnonzero(own_keys != their_keys)).size:
        i = int(bad[0])
        (shard, row), (their_shard, their_row) = positions[i], their_positions[i]
        check_keys(
            own_keys[i : i + 1],
            their_keys[i : i + 1],
            own_at=f"{layout.url(own_entries[shard]['path'])} (row {row})",
            runs=[(layout.url(their_entries[their_shard]["path"]), their_row, 1)],
        )
    return pa.table({c: own_rows.column(c) if c in own else their_rows.column(c) for c in wanted})


def _rows_at(
    layout: RunLayout,
    manifest: Manifest,
    expected: ShardSchema,
    positions: Sequence[tuple[int, int]],
    *,
    columns: Sequence[str] | None,
    verify: bool,
    needed_by: str | None = None,
) -> pa.Table:
    """The rows at `positions` of the stage's own shards, in the order given; `needed_by` names the
    stage whose rows they are read to join, for a checksum failure's message."""
    n, stage = manifest.data["iteration"], manifest.data["stage"]
    entries = shard_entries(manifest)
    by_shard: dict[int, list[int]] = {}
    for shard, row in positions:
        if not 0 <= shard < len(entries):
            raise IndexError(f"iteration {n} {stage} has {len(entries)} shard(s); no shard {shard}")
        by_shard.setdefault(shard, []).append(row)
    found: dict[tuple[int, int], pa.Table] = {}
    for shard, rows in by_shard.items():
        entry = entries[shard]
        parquet = open_shard(layout, entry, verify=verify, needed_by=needed_by)
        check_shard_schema(expected, parquet.schema_arrow, where=layout.url(entry["path"]))
        metadata = parquet.metadata
        starts = np.cumsum([0] + [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)])
        groups: dict[int, pa.Table] = {}
        for row in rows:
            if not 0 <= row < starts[-1]:
                raise IndexError(f"{layout.url(entry['path'])} has {starts[-1]} rows; no row {row}")
            group = bisect.bisect_right(starts.tolist(), row) - 1
            if group not in groups:
                groups[group] = parquet.read_row_group(group, columns=list(columns) if columns else None)
            found[(shard, row)] = groups[group].slice(row - int(starts[group]), 1)
        parquet.close()
    if not positions:
        return empty_table(layout, manifest, expected, columns)
    return pa.concat_tables([found[(shard, row)] for shard, row in positions])
