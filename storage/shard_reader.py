"""Reading committed stage shards: record batches, whole tables and per-row column dicts.

`read_batches(layout, n, stage)` iterates record batches of a committed stage, verifying each file's
sha256 against the manifest first (switchable off) and the schema name, version and layout of every
shard against the code's. `read_table` and `read_stage_columns` hold a whole (small) stage in memory.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from storage.errors import ChecksumMismatchError, SchemaVersionError
from storage.layout import RunLayout
from storage.manifest import Manifest, read_stage_manifest
from storage.objects import sha256_bytes, sha256_local_file
from storage.schemas import SCHEMAS, ShardSchema, check_shard_schema
from storage.shard_columns import LIST_KINDS, TOPK_KINDS, ragged, split_rows, topk


def expected_schema(manifest: Manifest, schema: ShardSchema | None) -> ShardSchema:
    """The schema the manifest's shards are read with: `schema`, or the one it names, at this code's version."""
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


def open_shard(layout: RunLayout, entry: Mapping[str, Any], *, verify: bool) -> pq.ParquetFile:
    """One shard of a manifest's file list, its sha256 checked first when `verify`."""
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
    """The manifest's file entries that are Parquet shards, in shard order."""
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
    expected = expected_schema(manifest, schema)
    for entry in shard_entries(manifest):
        parquet = open_shard(layout, entry, verify=verify)
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
        expected = expected_schema(manifest, schema)
        arrow = expected.arrow(top_k=recorded["top_k"], logprob_dtype=recorded["logprob_dtype"])
        return arrow.empty_table().select(list(columns)) if columns else arrow.empty_table()
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
