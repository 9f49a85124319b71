"""Reading committed stage shards: record batches, whole tables and per-row column dicts.

`read_batches(layout, n, stage)` iterates record batches of a committed stage, verifying each file's
sha256 against the manifest first (switchable off) and the schema name, version and layout of every
shard against the code's. `read_table` and `read_stage_columns` hold a whole (small) stage in memory.

A stage whose schema extends another stage's rows (the teacher's extends the rollout's) is read
joined: the columns asked for that its shards do not store come from the extended stage of the same
iteration. That stage's manifest must still have the digest recorded when the shards were written,
its shards are sha256-checked like the stage's own (`verify`), and its row count and every row's
`sample_id` must be the stage's; where they are not, `ShardJoinError` names both files.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from storage.errors import ChecksumMismatchError, SchemaVersionError, ShardJoinError
from storage.hashing import sha256_bytes, sha256_local_file
from storage.layout import RunLayout
from storage.manifest import Manifest, read_manifest, read_stage_manifest
from storage.schemas import JOIN_KEY, SCHEMAS, ShardSchema, check_shard_schema, version_mismatch
from storage.shard_columns import LIST_KINDS, TOPK_KINDS, ragged, split_rows, topk


def expected_schema(manifest: Manifest, schema: ShardSchema | None) -> ShardSchema:
    """The schema the manifest's shards are read with: `schema`, or the one it names, at this code's version."""
    recorded = manifest.data["schema"]
    if recorded is None:
        raise SchemaVersionError(f"{manifest.path} records no shard schema: the stage holds no shards")
    expected = schema or SCHEMAS[recorded["name"]]
    if (recorded["name"], recorded["version"]) != (expected.name, expected.version):
        where = f"{manifest.path} (code version {manifest.data['code_version']})"
        raise SchemaVersionError(version_mismatch(where, recorded["name"], recorded["version"], expected))
    return expected


def open_shard(
    layout: RunLayout, entry: Mapping[str, Any], *, verify: bool, needed_by: str | None = None
) -> pq.ParquetFile:
    """One shard of a manifest's file list, its sha256 checked first when `verify`; `needed_by`
    names the shard whose rows it is read to join, for the message."""
    url = layout.url(entry["path"])
    store = layout.store
    if store.backend == "file":
        path = store.path(url)
        if verify and (actual := sha256_local_file(path)) != entry["sha256"]:
            raise ChecksumMismatchError(url, expected=entry["sha256"], actual=actual, needed_by=needed_by)
        return pq.ParquetFile(path)
    if verify:
        data = store.read_bytes(url)
        if (actual := sha256_bytes(data)) != entry["sha256"]:
            raise ChecksumMismatchError(url, expected=entry["sha256"], actual=actual, needed_by=needed_by)
        return pq.ParquetFile(pa.BufferReader(data))
    return pq.ParquetFile(store.open_read(url))


def shard_entries(manifest: Manifest) -> list[dict[str, Any]]:
    """The manifest's file entries that are Parquet shards, in shard order."""
    return [f for f in manifest.data["files"] if f["path"].endswith(".parquet")]


def extended_stage(layout: RunLayout, manifest: Manifest, expected: ShardSchema) -> tuple[Manifest, ShardSchema]:
    """The committed stage whose rows `manifest`'s shards extend, and its schema, after checking that
    its manifest still has the digest recorded when the shards were written and as many rows."""
    if expected.extends is None:
        raise ValueError(f"{expected.name} shards extend no other stage's rows")
    ref = manifest.data["schema"]["extends"]
    extended = read_manifest(layout, layout.url(ref["path"]))
    own_url, their_url = layout.url(manifest.path), layout.url(extended.path)
    if extended.sha256 != ref["sha256"]:
        raise ChecksumMismatchError(their_url, expected=ref["sha256"], actual=extended.sha256, needed_by=own_url)
    if extended.data["rows"] != manifest.data["rows"]:
        raise ShardJoinError(
            f"{own_url} lists {manifest.data['rows']} rows but {their_url}, whose rows they extend, lists "
            f"{extended.data['rows']}"
        )
    return extended, expected_schema(extended, expected.extends)


def _stage_batches(
    layout: RunLayout,
    manifest: Manifest,
    expected: ShardSchema,
    columns: Sequence[str] | None,
    *,
    verify: bool,
    batch_rows: int,
) -> Iterator[tuple[pa.RecordBatch, str, int]]:
    """(batch, shard URL, first row of the batch in its shard) of the stage's own shards, in order."""
    for entry in shard_entries(manifest):
        url = layout.url(entry["path"])
        parquet = open_shard(layout, entry, verify=verify)
        metadata = parquet.schema_arrow.metadata
        check_shard_schema(expected, parquet.schema_arrow, where=url)
        start = 0
        for batch in parquet.iter_batches(batch_size=batch_rows, columns=list(columns) if columns else None):
            yield batch.replace_schema_metadata(metadata), url, start
            start += batch.num_rows
        parquet.close()


class _ExtendedRows:
    """The rows of an extended stage, in order, handed out in runs as long as the extending batches.
    Each shard is opened (and sha256-checked) when its first row is needed, naming the extending
    shard that needs it."""

    def __init__(
        self,
        layout: RunLayout,
        manifest: Manifest,
        schema: ShardSchema,
        columns: Sequence[str],
        *,
        verify: bool,
        batch_rows: int,
    ) -> None:
        self._layout, self._schema, self._columns = layout, schema, list(columns)
        self._verify, self._batch_rows = verify, batch_rows
        self._entries = iter(shard_entries(manifest))
        self._batches: Iterator[tuple[pa.RecordBatch, str, int]] = iter(())
        self._pending: list[tuple[pa.RecordBatch, str, int]] = []
        self._pending_rows = 0
        self._last_url = "no shard"  # the shard of the last rows read, for messages

    def _shard_batches(self, entry: Mapping[str, Any], needed_by: str) -> Iterator[tuple[pa.RecordBatch, str, int]]:
        url = self._layout.url(entry["path"])
        parquet = open_shard(self._layout, entry, verify=self._verify, needed_by=needed_by)
        check_shard_schema(self._schema, parquet.schema_arrow, where=url)
        start = 0
        for batch in parquet.iter_batches(batch_size=self._batch_rows, columns=self._columns):
            yield batch.replace_schema_metadata(None), url, start
            start += batch.num_rows
        parquet.close()

    def _next_batch(self, needed_by: str) -> tuple[pa.RecordBatch, str, int] | None:
        while (item := next(self._batches, None)) is None:
            entry = next(self._entries, None)
            if entry is None:
                return None
            self._batches = self._shard_batches(entry, needed_by)
        self._last_url = item[1]
        return item

    def take(self, n: int, *, needed_by: str) -> tuple[pa.Table, list[tuple[str, int, int]]]:
        """The next n rows, and (shard URL, first row in that shard, rows) of each run they came from."""
        while self._pending_rows < n:
            item = self._next_batch(needed_by)
            if item is None:
                raise ShardJoinError(
                    f"{needed_by} has more rows than the shards whose rows it extends, the last of which is "
                    f"{self._last_url}"
                )
            self._pending.append(item)
            self._pending_rows += item[0].num_rows
        taken, runs, need = [], [], n
        while need:
            batch, url, start = self._pending[0]
            part = batch.slice(0, need)
            taken.append(part)
            runs.append((url, start, part.num_rows))
            if part.num_rows == batch.num_rows:
                self._pending.pop(0)
            else:
                self._pending[0] = (batch.slice(need), url, start + need)
            need -= part.num_rows
        self._pending_rows -= n
        return pa.Table.from_batches(taken), runs

    def check_exhausted(self, *, needed_by: str) -> None:
        """Fail if rows are left once the extending stage's rows are all read."""
        rest = self._pending[0] if self._pending else self._next_batch(needed_by)
        while rest is not None and not rest[0].num_rows:
            rest = self._next_batch(needed_by)
        if rest is not None:
            raise ShardJoinError(f"{rest[1]} holds rows beyond the last row of {needed_by}, which extends its rows")


def check_keys(own: np.ndarray, theirs: np.ndarray, *, own_at: str, runs: Sequence[tuple[str, int, int]]) -> None:
    """Fail unless the join keys of a run of extending rows equal those of the rows they extend.
    `own_at` names the extending rows' file and first row; `runs` holds (file, first row, rows) of
    the extended rows, in order."""
    if own.shape == theirs.shape and np.array_equal(own, theirs):
        return
    first = f"{runs[0][0]} (rows from {runs[0][1]})" if runs else "no rows"
    if own.shape != theirs.shape:
        raise ShardJoinError(f"{own_at} holds {own.size} rows, but {theirs.size} rows of {first} to extend")
    i = int(np.flatnonzero(own != theirs)[0])
    their_at, before = first, 0
    for url, start, count in runs:
        if i < before + count:
            their_at = f"{url} (row {start + i - before})"
            break
        before += count
    raise ShardJoinError(
        f"{own_at} does not line up with {their_at}, whose rows it extends: its row {i} has "
        f"{JOIN_KEY} {own[i]}, the row it extends {JOIN_KEY} {theirs[i]}"
    )


def _joined_batches(
    layout: RunLayout,
    manifest: Manifest,
    expected: ShardSchema,
    columns: Sequence[str] | None,
    *,
    verify: bool,
    batch_rows: int,
) -> Iterator[pa.RecordBatch]:
    wanted = list(columns) if columns else list(expected.view_names)
    for name in wanted:
        expected.column(name)  # a KeyError naming the columns there are
    own = [c for c in wanted if c in expected.names]
    other = [c for c in wanted if c not in expected.names]
    if not other:
        for batch, _, _ in _stage_batches(layout, manifest, expected, own, verify=verify, batch_rows=batch_rows):
            yield batch
        return
    extended, extended_schema = extended_stage(layout, manifest, expected)
    rows = _ExtendedRows(layout, extended, extended_schema, [*other, JOIN_KEY], verify=verify, batch_rows=batch_rows)
    own_read = own if JOIN_KEY in own else [*own, JOIN_KEY]
    for batch, url, start in _stage_batches(layout, manifest, expected, own_read, verify=verify, batch_rows=batch_rows):
        if not batch.num_rows:
            continue
        theirs, runs = rows.take(batch.num_rows, needed_by=url)
        check_keys(
            batch.column(JOIN_KEY).to_numpy(),
            theirs.column(JOIN_KEY).to_numpy(),
            own_at=f"{url} (rows from {start})",
            runs=runs,
        )
        arrays = [batch.column(c) if c in own else theirs.column(c).combine_chunks() for c in wanted]
        fields = [batch.schema.field(c) if c in own else theirs.schema.field(c) for c in wanted]
        yield pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields, metadata=batch.schema.metadata))
    rows.check_exhausted(needed_by=layout.url(manifest.path))


def read_batches(
    layout: RunLayout,
    n: int,
    stage: str,
    *,
    columns: Sequence[str] | None = None,
    schema: ShardSchema | None = None,
    verify: bool = True,
    batch_rows: int = 1024,
) -> Iterator[pa.RecordBatch]:
    """Record batches of a committed stage, in shard order; each shard is sha256-checked first.

    `schema` pins the schema expected (default: the one the manifest names, at this code's version).
    A stage that extends another's rows is read joined (see the module docstring): its columns are
    `schema.view_names`. Batches carry the shard's schema metadata (schema name, version, K,
    logprob dtype).
    """
    manifest = read_stage_manifest(layout, n, stage)
    expected = expected_schema(manifest, schema)
    if expected.extends is not None:
        yield from _joined_batches(layout, manifest, expected, columns, verify=verify, batch_rows=batch_rows)
        return
    for batch, _, _ in _stage_batches(layout, manifest, expected, columns, verify=verify, batch_rows=batch_rows):
        yield batch


def empty_table(
    layout: RunLayout, manifest: Manifest, expected: ShardSchema, columns: Sequence[str] | None
) -> pa.Table:
    """The stage's (joined) columns, or `columns`, with no rows."""
    recorded = manifest.data["schema"]
    arrow = expected.arrow(top_k=recorded["top_k"], logprob_dtype=recorded["logprob_dtype"])
    if expected.extends is not None:
        extended, extended_schema = extended_stage(layout, manifest, expected)
        theirs = extended.data["schema"]
        fields = {
            f.name: f
            for f in [*extended_schema.arrow(top_k=theirs["top_k"], logprob_dtype=theirs["logprob_dtype"]), *arrow]
        }
        arrow = pa.schema([fields[name] for name in expected.view_names], metadata=arrow.metadata)
    table = arrow.empty_table()
    return table.select(list(columns)) if columns else table


def read_table(
    layout: RunLayout,
    n: int,
    stage: str,
    *,
    columns: Sequence[str] | None = None,
    schema: ShardSchema | None = None,
    verify: bool = True,
) -> pa.Table:
    """A whole committed stage as one table (for small stages; use read_batches to stream)."""
    batches = list(read_batches(layout, n, stage, columns=columns, schema=schema, verify=verify))
    if not batches:
        manifest = read_stage_manifest(layout, n, stage)
        return empty_table(layout, manifest, expected_schema(manifest, schema), columns)
    return pa.Table.from_batches(batches)


def read_stage_columns(
    layout: RunLayout,
    n: int,
    stage: str,
    *,
    columns: Sequence[str] | None = None,
    verify: bool = True,
) -> dict[str, Any]:
    """A whole committed stage as {column: per-row data} (small stages; read_batches streams).

    Numbers and booleans come as numpy arrays [N]; strings as lists; token and logprob lists as lists
    of numpy arrays [T_i]; top-K columns as lists of [T_i, K] arrays (views of one buffer);
    prompt_messages as lists of {"role", "content"} dicts.
    """
    manifest = read_stage_manifest(layout, n, stage)
    schema = expected_schema(manifest, None)
    table = read_table(layout, n, stage, columns=columns, verify=verify)
    out: dict[str, Any] = {}
    for name in table.column_names:
        kind = schema.column(name).kind
        if kind in TOPK_KINDS:
            values, offsets = topk(table, name)
            out[name] = split_rows(values, offsets)
        elif kind in LIST_KINDS:
            values, offsets = ragged(table, name)
            out[name] = split_rows(values, offsets)
        elif kind in ("string", "messages"):
            out[name] = table.column(name).to_pylist()
        else:
            out[name] = table.column(name).to_numpy()
    return out
