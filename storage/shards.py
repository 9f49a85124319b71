"""Stage shards: a streaming Parquet writer with bounded memory, and readers that hand out numpy.

Writing: `ShardWriter(stage, schema, top_k=K)` takes column dicts (numpy arrays, python lists, `Ragged`
or pyarrow arrays), checks the schema invariants, and writes row groups of `row_group_size` rows into
`part-<i>.parquet` files of at most `rows_per_shard` rows. At most one row group (plus the batch being
handed in) is held in memory. On s3 each shard is spooled to a local temp file and uploaded whole
(retried as a unit); on file:// and memory:// it is streamed in place. sha256 and byte counts are
taken while writing.

Reading: `read_batches(layout, n, stage)` iterates record batches of a committed stage, verifying each
file's sha256 against the manifest first (switchable off). `ragged(batch, col)` and `topk(batch, col)`
turn list columns into flat numpy values plus row offsets without per-row Python loops.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from storage.errors import ChecksumMismatchError, SchemaVersionError, ShardInvariantError
from storage.layout import RunLayout
from storage.manifest import Manifest, read_stage_manifest
from storage.objects import HashingSink, sha256_bytes, sha256_local_file
from storage.schemas import (
    SCHEMAS,
    STAGE_SCHEMAS,
    TOPK_LAYOUT,
    Column,
    LogprobDtype,
    ShardSchema,
    check_rows,
    check_shard_schema,
)
from storage.scratch import spool_file
from storage.stages import StageOutput

logger = logging.getLogger(__name__)

DEFAULT_ROWS_PER_SHARD = 4096
DEFAULT_ROW_GROUP_SIZE = 256
ZSTD_LEVEL = 1  # measured: levels 3-9 are no smaller on top-K data and up to 3x slower to write
_LIST_KINDS = ("tokens", "logprobs", "topk_ids", "topk_logprobs")
_TOPK_KINDS = ("topk_ids", "topk_logprobs")
_DICTIONARY_COLUMNS = (
    "prompt_id", "finish_reason", "label", "data_source", "teacher_source",
    "prompt_messages.list.element.role", "prompt_messages.list.element.content",
)
_MAX_LIST_VALUES = 2**31 - 1  # int32 list offsets


class Ragged(NamedTuple):
    """Variable-length rows as flat values plus offsets: row i is values[offsets[i]:offsets[i+1]].

    For top-K columns values is [N_tokens, K] and offsets count tokens.
    """

    values: np.ndarray  # [N_values] or [N_tokens, K]
    offsets: np.ndarray  # [N_rows + 1] int64, offsets[0] == 0


def parquet_options(schema: ShardSchema) -> dict[str, Any]:
    """Writer settings: zstd; BYTE_STREAM_SPLIT for numeric lists; dictionaries for repetitive strings."""
    leaves = {
        c.name: "list.element.list.element" if c.kind in _TOPK_KINDS else "list.element"
        for c in schema.columns
        if c.kind in _LIST_KINDS
    }
    return {
        "compression": "zstd",
        "compression_level": ZSTD_LEVEL,
        "use_dictionary": [c for c in _DICTIONARY_COLUMNS if c.split(".")[0] in schema.names],
        "column_encoding": {f"{name}.{leaf}": "BYTE_STREAM_SPLIT" for name, leaf in leaves.items()},
    }


# -- conversion of writer input --------------------------------------------------------------
def _check_messages(rows: Sequence[Any], name: str) -> None:
    for i, messages in enumerate(rows):
        for message in messages:
            if not isinstance(message, Mapping) or set(message) != {"role", "content"}:
                keys = sorted(message) if isinstance(message, Mapping) else type(message).__name__
                raise ShardInvariantError(f"{name}[{i}]: messages must be {{'role', 'content'}} dicts, got {keys}")


def _list_array(column: Column, typ: pa.ListType, value: Any, *, top_k: int) -> pa.Array:
    topk = column.kind in _TOPK_KINDS
    if isinstance(value, Ragged):
        values, offsets = np.asarray(value.values), np.asarray(value.offsets, dtype=np.int64)
    else:
        rows = [np.asarray(r) for r in value]
        lengths = np.array([len(r) for r in rows], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        empty = np.empty((0, top_k) if topk else (0,), dtype=np.float32)
        values = np.concatenate([r.reshape(-1, top_k) if topk and r.size == 0 else r for r in rows]) if rows else empty
    if topk and (values.ndim != 2 or values.shape[1] != top_k):
        raise ShardInvariantError(f"{column.name}: values must be [N_tokens, {top_k}], got shape {values.shape}")
    if not topk and values.ndim != 1:
        raise ShardInvariantError(f"{column.name}: values must be 1-D, got shape {values.shape}")
    n_entries = values.shape[0]
    rising = offsets.ndim == 1 and offsets.size > 0 and offsets[0] == 0 and offsets[-1] == n_entries
    if not rising or np.any(np.diff(offsets) < 0):
        raise ShardInvariantError(
            f"{column.name}: offsets must rise from 0 to {n_entries}, got {offsets[:3]}...{offsets[-2:]}"
        )
    if n_entries > _MAX_LIST_VALUES:
        raise ShardInvariantError(f"{column.name}: {n_entries} entries in one write; write smaller batches")
    entry_type = typ.value_type  # the item, or fixed_size_list<item, K> for top-K columns
    item = entry_type.value_type if topk else entry_type
    flat = values.reshape(-1)
    if pa.types.is_floating(item):
        leaves = pa.array(flat.astype(item.to_pandas_dtype(), copy=False))
    else:
        leaves = pa.array(flat).cast(item)  # safe cast: overflowing ids raise
    entries = pa.FixedSizeListArray.from_arrays(leaves, type=entry_type) if topk else leaves
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), entries, type=typ)


def _to_arrow(column: Column, typ: pa.DataType, value: Any, *, top_k: int) -> pa.Array:
    if isinstance(value, pa.ChunkedArray):
        value = value.combine_chunks()
    if isinstance(value, pa.Array):
        return value if value.type.equals(typ) else value.cast(typ)
    if column.kind == "messages":
        _check_messages(value, column.name)
        return pa.array(value, type=typ)
    if column.kind in _LIST_KINDS:
        return _list_array(column, typ, value, top_k=top_k)
    return pa.array(value, type=typ)


# -- writer ----------------------------------------------------------------------------------
@dataclass
class _OpenShard:
    url: str
    sink: HashingSink
    writer: pq.ParquetWriter
    spool: str | None  # local temp file uploaded on close (s3), else None
    rows: int = 0
    response_tokens: int = 0


class ShardWriter:
    """Streams rows of one schema into the Parquet shards of a stage (context manager)."""

    def __init__(
        self,
        stage: StageOutput,
        schema: ShardSchema,
        *,
        top_k: int,
        logprob_dtype: LogprobDtype = "float32",
        rows_per_shard: int = DEFAULT_ROWS_PER_SHARD,
        row_group_size: int = DEFAULT_ROW_GROUP_SIZE,
        spool_dir: str | None = None,
    ) -> None:
        if stage.stage in STAGE_SCHEMAS and STAGE_SCHEMAS[stage.stage] is not schema:
            raise ValueError(f"stage {stage.stage!r} holds {STAGE_SCHEMAS[stage.stage].name} shards, not {schema.name}")
        if not 1 <= row_group_size <= rows_per_shard:
            raise ValueError(f"need 1 <= row_group_size <= rows_per_shard, got {row_group_size}, {rows_per_shard}")
        self.stage = stage
        self.schema = schema
        self.top_k = top_k
        self.arrow_schema = schema.arrow(top_k=top_k, logprob_dtype=logprob_dtype)
        self.rows_per_shard = rows_per_shard
        self.row_group_size = row_group_size
        self.spool_dir = spool_dir
        self._options = parquet_options(schema)
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self._shard: _OpenShard | None = None
        self._next_index = 0
        self._sample_ids: set[int] = set()
        self._closed = False
        self.rows_written = 0
        stage._register_writer(
            {"name": schema.name, "version": schema.version, "top_k": top_k,
             "logprob_dtype": logprob_dtype, "topk_layout": TOPK_LAYOUT}
        )

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def to_table(self, columns: Mapping[str, Any]) -> pa.Table:
        """Convert and check one batch of rows (all columns of the schema, nothing else)."""
        missing = [n for n in self.schema.names if n not in columns]
        unknown = sorted(set(columns) - set(self.schema.names))
        if missing or unknown:
            raise ShardInvariantError(f"{self.schema.name} write: missing columns {missing}, unknown columns {unknown}")
        arrays = [
            _to_arrow(c, field.type, columns[c.name], top_k=self.top_k)
            for c, field in zip(self.schema.columns, self.arrow_schema, strict=True)
        ]
        lengths = {c.name: len(a) for c, a in zip(self.schema.columns, arrays, strict=True)}
        if len(set(lengths.values())) != 1:
            raise ShardInvariantError(f"{self.schema.name} write: columns have different row counts {lengths}")
        table = pa.Table.from_arrays(arrays, schema=self.arrow_schema)
        check_rows(self.schema, table, top_k=self.top_k, iteration=self.stage.iteration)
        return table

    def write(self, columns: Mapping[str, Any] | pa.Table) -> None:
        """Append rows; full row groups are written out as they fill."""
        if self._closed:
            raise ValueError("ShardWriter is closed")
        if isinstance(columns, pa.Table):
            columns = {name: columns[name] for name in columns.column_names}
        table = self.to_table(columns)
        ids = table.column("sample_id").to_numpy()
        duplicate_in_batch = np.unique(ids).size != ids.size
        seen = self._sample_ids.intersection(ids.tolist())
        if duplicate_in_batch or seen:
            which = sorted(seen)[:5] or "within the batch"
            raise ShardInvariantError(f"{self.schema.name} write: duplicate sample_id(s) {which}")
        self._sample_ids.update(ids.tolist())
        self._pending.append(table)
        self._pending_rows += table.num_rows
        while self._pending_rows >= self.row_group_size:
            self._flush(self.row_group_size)

    def _flush(self, n_rows: int) -> None:
        table = pa.concat_tables(self._pending)
        head, rest = table.slice(0, n_rows), table.slice(n_rows)
        self._pending = [rest] if rest.num_rows else []
        self._pending_rows = rest.num_rows
        while head.num_rows:
            shard = self._shard or self._open_shard()
            room = self.rows_per_shard - shard.rows
            part, head = head.slice(0, room), head.slice(room)
            shard.writer.write_table(part, row_group_size=part.num_rows)
            shard.rows += part.num_rows
            shard.response_tokens += int(pc.sum(pc.list_value_length(part.column("response_ids"))).as_py() or 0)
            if shard.rows == self.rows_per_shard:
                self._close_shard()

    def _open_shard(self) -> _OpenShard:
        layout, n = self.stage.layout, self.stage.iteration
        url = layout.shard(n, self.stage.stage, self._next_index)
        self._next_index += 1
        spool = None
        if layout.store.backend == "s3":
            fd, spool = spool_file("shard", ".parquet", folder=self.spool_dir)
            sink = HashingSink(os.fdopen(fd, "wb"), url=url)
        else:
            sink = HashingSink(layout.store.open_write(url), url=url)
        writer = pq.ParquetWriter(sink, self.arrow_schema, **self._options)
        self._shard = _OpenShard(url, sink, writer, spool)
        return self._shard

    def _close_shard(self) -> None:
        shard, self._shard = self._shard, None
        assert shard is not None
        shard.writer.close()
        metadata = shard.writer.writer.metadata
        shard.sink.close()
        if shard.spool is not None:
            try:
                self.stage.layout.store.put_local_file(shard.spool, shard.url)
            finally:
                os.unlink(shard.spool)
        column_bytes: dict[str, int] = {}
        for g in range(metadata.num_row_groups):
            row_group = metadata.row_group(g)
            for c in range(row_group.num_columns):
                chunk = row_group.column(c)
                name = chunk.path_in_schema.split(".")[0]
                column_bytes[name] = column_bytes.get(name, 0) + chunk.total_compressed_size
        self.stage._add_file(
            {
                "path": self.stage.layout.relative(shard.url),
                "bytes": shard.sink.bytes_written,
                "sha256": shard.sink.hexdigest(),
                "rows": shard.rows,
                "response_tokens": shard.response_tokens,
                "column_bytes": column_bytes,
            }
        )
        self.rows_written += shard.rows

    def close(self) -> None:
        """Write what is pending and close the last shard."""
        if self._closed:
            return
        if self._pending_rows:
            self._flush(self._pending_rows)
        if self._shard is not None:
            self._close_shard()
        self._closed = True
        self.stage._writer_closed()

    def abort(self) -> None:
        """Drop pending rows and close handles; written files stay partial (cleared on the rerun)."""
        if self._closed:
            return
        self._pending, self._pending_rows = [], 0
        if self._shard is not None:
            shard, self._shard = self._shard, None
            shard.writer.close()
            shard.sink.close()
            if shard.spool is not None:
                os.unlink(shard.spool)
        self._closed = True
        self.stage._writer_closed()


# -- readers ---------------------------------------------------------------------------------
def _expected_schema(manifest: Manifest, schema: ShardSchema | None) -> ShardSchema:
    recorded = manifest.data["schema"]
    if recorded is None:
        raise SchemaVersionError(f"{manifest.path} records no shard schema: the stage holds no shards")
    expected = schema or SCHEMAS[recorded["name"]]
    if (recorded["name"], recorded["version"]) != (expected.name, expected.version):
        raise SchemaVersionError(
            f"{manifest.path} was written with {recorded['name']} schema v{recorded['version']}; this code reads "
            f"{expected.name} schema v{expected.version}"
        )
    return expected


def _open_parquet(layout: RunLayout, entry: Mapping[str, Any], *, verify: bool) -> pq.ParquetFile:
    url = layout.url(entry["path"])
    store = layout.store
    if store.backend == "file":
        path = store.path(url)
        if verify and (actual := sha256_local_file(path)) != entry["sha256"]:
            raise ChecksumMismatchError(url, expected=entry["sha256"], actual=actual)
        return pq.ParquetFile(path)
    if verify:
        data = store.read_bytes(url)
        if (actual := sha256_bytes(data)) != entry["sha256"]:
            raise ChecksumMismatchError(url, expected=entry["sha256"], actual=actual)
        return pq.ParquetFile(pa.BufferReader(data))
    return pq.ParquetFile(store.open_read(url))


def shard_entries(manifest: Manifest) -> list[dict[str, Any]]:
    return [f for f in manifest.data["files"] if f["path"].endswith(".parquet")]


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
    Batches carry the shard's schema metadata (schema name, version, K, logprob dtype).
    """
    manifest = read_stage_manifest(layout, n, stage)
    expected = _expected_schema(manifest, schema)
    for entry in shard_entries(manifest):
        parquet = _open_parquet(layout, entry, verify=verify)
        metadata = parquet.schema_arrow.metadata
        check_shard_schema(expected, parquet.schema_arrow, where=layout.url(entry["path"]))
        for batch in parquet.iter_batches(batch_size=batch_rows, columns=list(columns) if columns else None):
            yield batch.replace_schema_metadata(metadata)
        parquet.close()


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
        recorded = manifest.data["schema"]
        expected = _expected_schema(manifest, schema)
        arrow = expected.arrow(top_k=recorded["top_k"], logprob_dtype=recorded["logprob_dtype"])
        return arrow.empty_table().select(list(columns)) if columns else arrow.empty_table()
    return pa.Table.from_batches(batches)


def ragged(batch: pa.RecordBatch | pa.Table, column: str) -> Ragged:
    """(values [N_values], offsets [N_rows + 1]) of a list column; zero-copy where Arrow allows."""
    array = batch.column(column)
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    offsets = array.offsets.to_numpy().astype(np.int64)
    return Ragged(values=array.flatten().to_numpy(), offsets=offsets - offsets[0])


def topk(batch: pa.RecordBatch | pa.Table, column: str) -> Ragged:
    """(values [N_tokens, K], token offsets [N_rows + 1]) of a top-K column."""
    array = batch.column(column)
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if not (pa.types.is_list(array.type) and pa.types.is_fixed_size_list(array.type.value_type)):
        raise SchemaVersionError(f"column {column!r} has type {array.type}, not a top-K list<fixed_size_list<K>>")
    k = array.type.value_type.list_size
    offsets = array.offsets.to_numpy().astype(np.int64)
    values = array.flatten().flatten().to_numpy()
    return Ragged(values=values.reshape(-1, k), offsets=offsets - offsets[0])


# -- whole-stage conveniences (small stages: everything in memory) ----------------------------
def _infer_top_k(value: Any) -> int | None:
    if isinstance(value, Ragged):
        return int(np.asarray(value.values).shape[1])
    if isinstance(value, pa.ChunkedArray | pa.Array):
        return int(value.type.value_type.list_size) if pa.types.is_fixed_size_list(value.type.value_type) else None
    for row in value:
        shape = np.asarray(row).shape
        if len(shape) == 2 and shape[0] > 0:
            return int(shape[1])
    return None


def write_stage(
    layout: RunLayout,
    n: int,
    stage: str,
    columns: Mapping[str, Any],
    *,
    top_k: int | None = None,
    logprob_dtype: LogprobDtype = "float32",
    parents: Sequence[Manifest | Mapping[str, str]] = (),
    metrics: Mapping[str, Any] | None = None,
    timings: Mapping[str, float] | None = None,
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD,
    row_group_size: int = DEFAULT_ROW_GROUP_SIZE,
) -> Manifest:
    """Write one column dict as the whole shard output of a rollout or teacher stage and commit it.

    `top_k` defaults to the K of the `topk_ids` rows (pass it when there may be no rows).
    """
    if stage not in STAGE_SCHEMAS:
        raise ValueError(f"write_stage writes shard stages {tuple(STAGE_SCHEMAS)}, not {stage!r}")
    k = top_k if top_k is not None else _infer_top_k(columns["topk_ids"])
    if k is None:
        raise ValueError(f"cannot infer top_k for {stage} of iteration {n} from empty topk_ids; pass top_k")
    output = StageOutput(layout, n, stage)
    with ShardWriter(output, STAGE_SCHEMAS[stage], top_k=k, logprob_dtype=logprob_dtype,
                     rows_per_shard=rows_per_shard, row_group_size=row_group_size) as writer:
        writer.write(columns)
    return output.commit(parents=parents, metrics=metrics, timings=timings)


def _split(values: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    return np.split(values, offsets[1:-1]) if offsets.size > 1 else []


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
    schema = _expected_schema(manifest, None)
    table = read_table(layout, n, stage, columns=columns, verify=verify)
    out: dict[str, Any] = {}
    for name in table.column_names:
        kind = schema.column(name).kind
        if kind in _TOPK_KINDS:
            values, offsets = topk(table, name)
            out[name] = _split(values, offsets)
        elif kind in _LIST_KINDS:
            values, offsets = ragged(table, name)
            out[name] = _split(values, offsets)
        elif kind in ("string", "messages"):
            out[name] = table.column(name).to_pylist()
        else:
            out[name] = table.column(name).to_numpy()
    return out
