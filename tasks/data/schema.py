"""The schema of prepared prompt data, checked row by row when a run reads it.

A row (docs/tasks.md, "Prepared data") needs `prompt_id` (non-empty text), `prompt_messages` (a
non-empty list of {"role", "content"} objects with text values), `label` (text) and `data_source`
(text); `metadata` is optional (an object, or JSON text of one in Parquet). Within a file prompt ids
are unique and so are prompts (the same messages twice would land on both sides of a held-out
split); a separate eval file shares no prompt id and no prompt with the training file. Every error
names the file and line (or row) and the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tasks.data.files import read_parsed_records
from tasks.data.rows import InvalidRowError

__all__ = ["check_disjoint", "prompt_key", "read_checked"]

Row = dict[str, Any]
_TEXT_FIELDS = ("prompt_id", "label", "data_source")


def _check_row(where: str, record: Any) -> Row:
    if not isinstance(record, dict):
        raise InvalidRowError(where, f"a row must be a JSON object, got {type(record).__name__}")
    for field in (*_TEXT_FIELDS, "prompt_messages"):
        if field not in record:
            raise InvalidRowError(where, f"missing required field {field!r}")
    for field in _TEXT_FIELDS:
        if not isinstance(record[field], str):
            raise InvalidRowError(where, f"field {field!r} must be text, got {type(record[field]).__name__}")
    if not record["prompt_id"].strip():
        raise InvalidRowError(where, "field 'prompt_id' is empty")
    messages = record["prompt_messages"]
    if not isinstance(messages, list) or not messages:
        raise InvalidRowError(
            where, f"field 'prompt_messages' must be a non-empty list of messages, got {type(messages).__name__}"
        )
    for k, message in enumerate(messages):
        if not (
            isinstance(message, Mapping)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise InvalidRowError(where, f"prompt_messages[{k}] must be an object with text 'role' and 'content'")
    metadata = record.get("metadata")
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata)
        except json.JSONDecodeError as err:
            raise InvalidRowError(where, f"field 'metadata' is not JSON text ({err.msg})") from None
    if metadata is not None and not isinstance(metadata, dict):
        raise InvalidRowError(where, f"field 'metadata' must be an object, got {type(metadata).__name__}")
    row = dict(record)
    row["prompt_messages"] = [dict(m) for m in messages]
    row["metadata"] = metadata if metadata is not None else {}
    return row


def prompt_key(row: Row) -> str:
    """The identity of a row's prompt: two rows with equal keys ask the model the same thing."""
    return json.dumps(row["prompt_messages"], sort_keys=True, ensure_ascii=False)


def read_checked(url: str, *, storage_options: Mapping[str, Any] | None = None) -> tuple[list[Row], dict[str, str]]:
    """(rows, prompt id -> "file:line") of a prepared data file, every row checked (see the module
    docstring); InvalidRowError names the first bad row, ValueError an empty file."""
    rows: list[Row] = []
    places: dict[str, str] = {}
    prompts: dict[str, str] = {}
    for where, record in read_parsed_records(url, storage_options=storage_options):
        row = _check_row(where, record)
        pid = row["prompt_id"]
        if pid in places:
            raise InvalidRowError(where, f"duplicate prompt_id {pid!r} (first at {places[pid]})")
        key = prompt_key(row)
        if key in prompts:
            raise InvalidRowError(where, f"the same prompt as {prompts[key]} (prompts must be unique)")
        places[pid], prompts[key] = where, where
        rows.append(row)
    if not rows:
        raise ValueError(f"{url}: the data file holds no rows")
    return rows, places


def check_disjoint(
    train: list[Row], train_places: dict[str, str], held_out: list[Row], held_out_places: dict[str, str]
) -> None:
    """InvalidRowError for a held-out row whose prompt id or prompt also appears in training."""
    train_prompts = {prompt_key(r): train_places[r["prompt_id"]] for r in train}
    for row in held_out:
        pid, where = row["prompt_id"], held_out_places[row["prompt_id"]]
        if pid in train_places:
            raise InvalidRowError(where, f"prompt_id {pid!r} is also in the training data ({train_places[pid]})")
        other = train_prompts.get(prompt_key(row))
        if other is not None:
            raise InvalidRowError(where, f"the same prompt is in the training data ({other}): eval would leak")
