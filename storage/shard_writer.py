"""Writing stage shards: a streaming Parquet writer with bounded memory.

`ShardWriter(stage, schema, top_k=K)` takes column dicts (numpy arrays, python lists, `Ragged` or
pyarrow arrays), checks the schema invariants, and writes row groups of `row_group_size` rows into
`part-<i>.parquet` files of at most `rows_per_shard` rows. At most one row group (plus the batch being
handed in) is held in memory. On s3 each shard is spooled to a local temp file and uploaded whole
(retried as a unit); on file:// and memory:// it is streamed in place. sha256 and byte counts are
taken while writing. `write_shards` writes one column dict as the whole output of a stage and
returns it for the caller to commit.

A schema that extends another stage's rows (the teacher's) is written after that stage of the same
iteration is committed: the writer reads its `sample_id`s and response lengths once, and every row
written must carry the `sample_id` of the extended row at the same position and per-token columns of
its length; closing checks that every extended row got its row. The manifest's schema records the
extended stage's manifest by digest (`extends`), and the commit must name it as a parent.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from storage.errors import ShardInvariantError
from storage.hashing import HashingSink
from storage.layout import RunLayout
from storage.manifest import Manifest, read_stage_manifest
from storage.schemas import (
    JOIN_KEY,
    PER_TOKEN_KINDS,
    STAGE_SCHEMAS,
    TOPK_LAYOUT,
    LogprobDtype,
    ShardSchema,
    check_rows,
    row_lengths,
)
from storage.scratch import spool_file
from storage.shard_columns import LIST_KINDS, TOPK_KINDS, infer_top_k, to_arrow
from storage.shard_reader import read_table
from storage.stages import StageOutput

DEFAULT_ROWS_PER_SHARD = 4096
DEFAULT_ROW_GROUP_SIZE = 256
ZSTD_LEVEL = 1  # measured: levels 3-9 are no smaller on top-K data and up to 3x slower to write
_DICTIONARY_COLUMNS = (
    "prompt_id",
    "finish_reason",
    "label",
    "data_source",
    "teacher_source",
    "prompt_messages.list.element.role",
    "prompt_messages.list.element.content",
)


def parquet_options(schema: ShardSchema) -> dict[str, Any]:
    """Writer settings: zstd; BYTE_STREAM_SPLIT for numeric lists; dictionaries for repetitive strings."""
    leaves = {
        c.name: "list.element.list.element" if c.kind in TOPK_KINDS else "list.element"
        for c in schema.columns
        if c.kind in LIST_KINDS
    }
    return {
        "compression": "zstd",
        "compression_level": ZSTD_LEVEL,
        "use_dictionary": [c for c in _DICTIONARY_COLUMNS if c.split(".")[0] in schema.names],
        "column_encoding": {f"{name}.{leaf}": "BYTE_STREAM_SPLIT" for name, leaf in leaves.items()},
    }


def tokens_column(schema: ShardSchema) -> str:
    """The column whose row lengths count a shard's response tokens."""
    if "response_ids" in schema.names:
        return "response_ids"
    return next(c.name for c in schema.columns if c.kind in PER_TOKEN_KINDS)


# -- writer ----------------------------------------------------------------------------------
@dataclass
class ExtendedRows:
    """The rows a shard writer's rows extend: the keys and response lengths of a committed stage."""

    manifest: Manifest
    url: str
    keys: np.ndarray  # [N] int64 sample_id, in row order
    response_lengths: np.ndarray  # [N] int64 len(response_ids)

    @classmethod
    def read(cls, layout: RunLayout, n: int, schema: ShardSchema) -> ExtendedRows:
        if schema.extends is None:
            raise ValueError(f"{schema.name} shards extend no other stage's rows")
        manifest = read_stage_manifest(layout, n, schema.extends.name)
        # the keys only; every joined read checks the files' sha256 and these keys again
        table = read_table(layout, n, schema.extends.name, columns=[JOIN_KEY, "response_ids"], verify=False)
        return cls(
            manifest=manifest,
            url=layout.url(manifest.path),
            keys=table.column(JOIN_KEY).to_numpy(),
            response_lengths=row_lengths(table.column("response_ids").combine_chunks()),
        )

    def lengths_of(self, keys: np.ndarray, *, start: int, schema: ShardSchema) -> np.ndarray:  # [len(keys)]
        """The response lengths of rows `start`.. when `keys` are theirs, else ShardInvariantError."""
        end = start + keys.size
        if end > self.keys.size:
            raise ShardInvariantError(
                f"{schema.name} write: rows {start}..{end - 1}, but {self.url} has {self.keys.size} rows to extend"
            )
        want = self.keys[start:end]
        if (bad := np.flatnonzero(keys != want)).size:
            i = int(bad[0])
            raise ShardInvariantError(
                f"{schema.name} write: row {start + i} has {JOIN_KEY} {keys[i]}, but row {start + i} of {self.url} "
                f"has {want[i]}: {schema.name} rows are the {self.manifest.data['stage']} rows, in their order"
            )
        lengths: np.ndarray = self.response_lengths[start:end]
        return lengths


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
        self._rows_in = 0  # rows accepted by write()
        self._tokens_column = tokens_column(schema)
        self._closed = False
        self.rows_written = 0
        info: dict[str, Any] = {
            "name": schema.name,
            "version": schema.version,
            "top_k": top_k,
            "logprob_dtype": logprob_dtype,
            "topk_layout": TOPK_LAYOUT,
        }
        self._extended = None
        if schema.extends is not None:
            self._extended = ExtendedRows.read(stage.layout, stage.iteration, schema)
            if (their_k := self._extended.manifest.data["schema"]["top_k"]) != top_k:
                raise ValueError(
                    f"{schema.name} shards of K = {top_k} cannot extend {self._extended.url} (K = {their_k})"
                )
            info["extends"] = self._extended.manifest.ref
        stage._register_writer(info)

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
            to_arrow(c, field.type, columns[c.name], top_k=self.top_k)
            for c, field in zip(self.schema.columns, self.arrow_schema, strict=True)
        ]
        lengths = {c.name: len(a) for c, a in zip(self.schema.columns, arrays, strict=True)}
        if len(set(lengths.values())) != 1:
            raise ShardInvariantError(f"{self.schema.name} write: columns have different row counts {lengths}")
        table = pa.Table.from_arrays(arrays, schema=self.arrow_schema)
        response_lengths = None
        if self._extended is not None:
            keys = table.column(JOIN_KEY).to_numpy()
            response_lengths = self._extended.lengths_of(keys, start=self._rows_in, schema=self.schema)
        check_rows(
            self.schema, table, top_k=self.top_k, iteration=self.stage.iteration, response_lengths=response_lengths
        )
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
        self._rows_in += table.num_rows
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
            tokens = pc.list_value_length(part.column(self._tokens_column))
            shard.response_tokens += int(pc.sum(tokens).as_py() or 0)
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
        if self._extended is not None and self._rows_in != self._extended.keys.size:
            raise ShardInvariantError(
                f"{self.schema.name} write: {self._rows_in} rows written, but {self._extended.url} has "
                f"{self._extended.keys.size} rows to extend"
            )
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


def write_shards(
    layout: RunLayout,
    n: int,
    stage: str,
    columns: Mapping[str, Any],
    *,
    top_k: int | None = None,
    logprob_dtype: LogprobDtype = "float32",
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD,
    row_group_size: int = DEFAULT_ROW_GROUP_SIZE,
) -> StageOutput:
    """Write one column dict as the whole shard output of a rollout or teacher stage, not yet
    committed: `write_shards(...).commit(parents=..., metrics=...)` writes its manifest, last, so a
    stage's recorded seconds can include the writing.

    `top_k` defaults to the K of the rows of the schema's first top-K column (pass it when there may
    be no rows).
    """
    if stage not in STAGE_SCHEMAS:
        raise ValueError(f"write_shards writes shard stages {tuple(STAGE_SCHEMAS)}, not {stage!r}")
    schema = STAGE_SCHEMAS[stage]
    first_topk = next(c.name for c in schema.columns if c.kind in TOPK_KINDS)
    k = top_k if top_k is not None else infer_top_k(columns[first_topk])
    if k is None:
        raise ValueError(f"cannot infer top_k for {stage} of iteration {n} from empty {first_topk}; pass top_k")
    output = StageOutput(layout, n, stage)
    with ShardWriter(
        output,
        schema,
        top_k=k,
        logprob_dtype=logprob_dtype,
        rows_per_shard=rows_per_shard,
        row_group_size=row_group_size,
    ) as writer:
        writer.write(columns)
    return output
