"""List and top-K shard columns between numpy and Arrow, without per-row Python loops.

Writer input: `to_arrow(column, type, value, top_k=K)` takes numpy arrays, python lists, `Ragged` or
pyarrow arrays and checks the shapes and offsets of list columns (token and logprob lists are
list<item>; top-K columns are list<fixed_size_list<item, K>>, see `storage.schemas.TOPK_LAYOUT`).

Reader output: `ragged(batch, col)` and `topk(batch, col)` turn list columns into flat numpy values
plus row offsets, zero-copy where Arrow allows; `split_rows` cuts those into per-row arrays.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from storage.errors import SchemaVersionError, ShardInvariantError
from storage.schemas import Column

LIST_KINDS = ("tokens", "logprobs", "entropies", "topk_ids", "topk_logprobs")
TOPK_KINDS = ("topk_ids", "topk_logprobs")
_MAX_LIST_VALUES = 2**31 - 1  # int32 list offsets


class Ragged(NamedTuple):
    """Variable-length rows as flat values plus offsets: row i is values[offsets[i]:offsets[i+1]].

    For top-K columns values is [N_tokens, K] and offsets count tokens.
    """

    values: np.ndarray  # [N_values] or [N_tokens, K]
    offsets: np.ndarray  # [N_rows + 1] int64, offsets[0] == 0


# -- writer input ----------------------------------------------------------------------------
def _check_messages(rows: Sequence[Any], name: str) -> None:
    for i, messages in enumerate(rows):
        for message in messages:
            if not isinstance(message, Mapping) or set(message) != {"role", "content"}:
                keys = sorted(message) if isinstance(message, Mapping) else type(message).__name__
                raise ShardInvariantError(f"{name}[{i}]: messages must be {{'role', 'content'}} dicts, got {keys}")


def _list_array(column: Column, typ: pa.ListType, value: Any, *, top_k: int) -> pa.Array:
    topk = column.kind in TOPK_KINDS
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


def to_arrow(column: Column, typ: pa.DataType, value: Any, *, top_k: int) -> pa.Array:
    if isinstance(value, pa.ChunkedArray):
        value = value.combine_chunks()
    if isinstance(value, pa.Array):
        return value if value.type.equals(typ) else value.cast(typ)
    if column.kind == "messages":
        _check_messages(value, column.name)
        return pa.array(value, type=typ)
    if column.kind in LIST_KINDS:
        return _list_array(column, typ, value, top_k=top_k)
    return pa.array(value, type=typ)


# -- reader output ---------------------------------------------------------------------------
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


def infer_top_k(value: Any) -> int | None:
    if isinstance(value, Ragged):
        return int(np.asarray(value.values).shape[1])
    if isinstance(value, pa.ChunkedArray | pa.Array):
        return int(value.type.value_type.list_size) if pa.types.is_fixed_size_list(value.type.value_type) else None
    for row in value:
        shape = np.asarray(row).shape
        if len(shape) == 2 and shape[0] > 0:
            return int(shape[1])
    return None


def split_rows(values: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    return np.split(values, offsets[1:-1]) if offsets.size > 1 else []
