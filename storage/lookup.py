"""Random access to rows of a committed shard stage: an index of positions, then single rows.

A reader that shows one sample at a time (the viewer) should not stream a whole stage per request.
`read_index` reads the named columns of every row once (each shard sha256-checked), adding each
row's position: `_shard` (index into the manifest's shard list) and `_row` (row within that shard).
`read_rows` then reads just the row groups holding the requested positions.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from storage.layout import RunLayout
from storage.manifest import Manifest, read_stage_manifest
from storage.schemas import ShardSchema, check_shard_schema
from storage.shard_reader import expected_schema, open_shard, shard_entries

SHARD_COLUMN = "_shard"
ROW_COLUMN = "_row"


def read_index(layout: RunLayout, n: int, stage: str, *, columns: Sequence[str], verify: bool = True) -> pa.Table:
    """`columns` of every row of a committed stage, plus `_shard` and `_row` (int32) positions."""
    manifest = read_stage_manifest(layout, n, stage)
    expected = expected_schema(manifest, None)
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
        empty = _empty(manifest, expected, columns)
        empty = empty.append_column(SHARD_COLUMN, pa.array([], type=pa.int32()))
        return empty.append_column(ROW_COLUMN, pa.array([], type=pa.int32()))
    return pa.concat_tables(tables)


def _empty(manifest: Manifest, expected: ShardSchema, columns: Sequence[str] | None) -> pa.Table:
    recorded = manifest.data["schema"]
    table = expected.arrow(top_k=recorded["top_k"], logprob_dtype=recorded["logprob_dtype"]).empty_table()
    return table.select(list(columns)) if columns else table


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
    entries = shard_entries(manifest)
    by_shard: dict[int, list[int]] = {}
    for shard, row in positions:
        if not 0 <= shard < len(entries):
            raise IndexError(f"iteration {n} {stage} has {len(entries)} shard(s); no shard {shard}")
        by_shard.setdefault(shard, []).append(row)
    found: dict[tuple[int, int], pa.Table] = {}
    for shard, rows in by_shard.items():
        entry = entries[shard]
        parquet = open_shard(layout, entry, verify=verify)
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
        return _empty(manifest, expected, columns)
    return pa.concat_tables([found[(shard, row)] for shard, row in positions])
