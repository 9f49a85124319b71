"""Reading data-set inputs (JSON lines, JSON, Parquet, Arrow, gzip; local, storage URL or `pkg:`)
and writing prepared prompt data (JSONL or Parquet, whole and atomically through `storage/`)."""

from __future__ import annotations

import gzip
import importlib.util
import io
import itertools
import json
from collections.abc import Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from storage.objects import ObjectStore
from storage.retry import RetryPolicy
from storage.urls import resolve
from tasks.data.rows import InvalidRowError, Row


class Malformed:
    """A record that could not even be parsed (bad JSON line)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def resolve_input(spec: str) -> str:
    """`pkg:<module>/<relative>` -> the file inside the installed package; anything else unchanged."""
    if not spec.startswith("pkg:"):
        return spec
    module, _, relative = spec[len("pkg:") :].partition("/")
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(f"package {module!r} is not installed (needed for input {spec!r})")
    return str(Path(list(found.submodule_search_locations)[0]) / relative)


def read_bytes(url: str, storage_options: Mapping[str, Any] | None) -> bytes:
    fs, path = resolve(url, storage_options)
    data = fs.cat_file(path)
    return gzip.decompress(data) if url.endswith(".gz") else data


def file_name(url: str) -> str:
    return PurePosixPath(url.split("://", 1)[-1]).name


class DuplicateKey(ValueError):
    """A JSON object that gives one key twice (JSON keeps the last without a word)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"the key {key[:80]!r} is given twice in one object; keep one of them")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(key)
        out[key] = value
    return out


def load_json(text: str | bytes) -> Any:
    """json.loads, refusing an object that gives a key twice (DuplicateKey) at any depth."""
    return json.loads(text, object_pairs_hook=_unique_keys)


def _not_utf8(byte: int, column: int) -> str:
    return f"not UTF-8 text (byte 0x{byte:02x} at byte {column} of the line); save the file as UTF-8"


def json_lines(data: bytes, name: str) -> Iterator[tuple[str, Any]]:
    """(file:line, record) per line; a line that is not UTF-8 or not JSON is a Malformed record.
    Lines end at \\n, \\r\\n or \\r only: other line separators may sit inside a JSON string."""
    for number, raw in enumerate(data.splitlines(), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            yield f"{name}:{number}", Malformed(_not_utf8(raw[err.start], err.start + 1))
            continue
        if not line.strip():
            continue
        try:
            yield f"{name}:{number}", load_json(line)
        except json.JSONDecodeError as exc:
            yield f"{name}:{number}", Malformed(f"not valid JSON ({exc.msg} at column {exc.colno})")
        except DuplicateKey as exc:
            yield f"{name}:{number}", Malformed(str(exc))


def _duplicate_in_document(data: bytes, name: str) -> Iterator[tuple[str, Any]]:
    """The items of a whole-file JSON document that gives a key twice somewhere, decoded one by one
    so that each item that does is a Malformed record named by its number (the rest as read)."""
    text = data.decode("utf-8")
    checked, plain = json.JSONDecoder(object_pairs_hook=_unique_keys), json.JSONDecoder()
    position = len(text) - len(text.lstrip())
    in_list = text.startswith("[", position)
    position += in_list
    for k in itertools.count():
        while in_list and text[position] in " \t\r\n,":
            position += 1
        if in_list and text[position] == "]" or not in_list and k == 1:
            return
        try:
            item, position = checked.raw_decode(text, position)
            yield f"{name}: item {k + 1}", item
        except DuplicateKey as exc:
            yield f"{name}: item {k + 1}", Malformed(str(exc))
            _, position = plain.raw_decode(text, position)


def not_utf8_error(data: bytes, name: str, err: UnicodeDecodeError) -> InvalidRowError:
    """The error for the undecodable byte of `err` in the file `name`, naming its line."""
    line = data.count(b"\n", 0, err.start) + 1
    column = err.start - data.rfind(b"\n", 0, err.start)
    return InvalidRowError(f"{name}:{line}", _not_utf8(data[err.start], column))


def arrow_rows(data: bytes) -> list[Row]:
    import pyarrow as pa

    try:
        table = pa.ipc.open_stream(pa.BufferReader(data)).read_all()  # HF save_to_disk files
    except pa.ArrowInvalid:
        table = pa.ipc.open_file(pa.BufferReader(data)).read_all()
    return table.to_pylist()


def read_records(url: str, *, storage_options: Mapping[str, Any] | None = None) -> Iterator[tuple[str, Any]]:
    """(location, record) for every record of a JSON-lines, JSON, Parquet or Arrow file (optionally .gz).

    A `.json` file holding several JSON documents, one per line, is read as JSON lines (the paper's
    data files are). An Arrow input may be a folder: its `*.arrow` files are read in name order.
    """
    name = file_name(url)
    stem = name[:-3] if name.endswith(".gz") else name
    fs, path = resolve(url, storage_options)
    if fs.isdir(path):
        files = sorted(p for p in fs.ls(path, detail=False) if p.endswith(".arrow"))
        if not files:
            raise FileNotFoundError(f"{url} is a folder without .arrow files")
        for file in files:
            for k, row in enumerate(arrow_rows(fs.cat_file(file))):
                yield f"{file_name(file)}: row {k + 1}", row
        return
    data = read_bytes(url, storage_options)
    if stem.endswith(".jsonl"):
        yield from json_lines(data, name)
    elif stem.endswith(".json"):
        try:
            value = load_json(data)
        except UnicodeDecodeError as err:
            raise not_utf8_error(data, name, err) from None
        except json.JSONDecodeError:
            yield from json_lines(data, name)
            return
        except DuplicateKey:
            yield from _duplicate_in_document(data, name)
            return
        items = value if isinstance(value, list) else [value]
        for k, item in enumerate(items):
            yield f"{name}: item {k + 1}", item
    elif stem.endswith(".parquet"):
        import pyarrow.parquet as pq

        for k, row in enumerate(pq.read_table(io.BytesIO(data)).to_pylist()):
            yield f"{name}: row {k + 1}", row
    elif stem.endswith(".arrow"):
        for k, row in enumerate(arrow_rows(data)):
            yield f"{name}: row {k + 1}", row
    else:
        raise ValueError(
            f"cannot tell the format of {url!r}: expected .jsonl, .json, .parquet or .arrow (optionally .gz)"
        )


def read_parsed_records(url: str, *, storage_options: Mapping[str, Any] | None = None) -> Iterator[tuple[str, Any]]:
    """`read_records`, raising InvalidRowError for a record that is not valid JSON."""
    for where, record in read_records(url, storage_options=storage_options):
        if isinstance(record, Malformed):
            raise InvalidRowError(where, record.reason)
        yield where, record


def encode_rows(rows: list[Row], url: str) -> bytes:
    if file_name(url).endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        message = pa.struct(
            [pa.field("role", pa.string(), nullable=False), pa.field("content", pa.string(), nullable=False)]
        )
        schema = pa.schema(
            [
                pa.field("prompt_id", pa.string(), nullable=False),
                pa.field("prompt_messages", pa.list_(pa.field("element", message, nullable=False)), nullable=False),
                pa.field("label", pa.string(), nullable=False),
                pa.field("data_source", pa.string(), nullable=False),
                pa.field("metadata", pa.string(), nullable=False, metadata={"encoding": "json"}),
            ]
        )
        table = pa.Table.from_pylist(
            [
                {
                    **r,
                    "prompt_messages": [{"role": m["role"], "content": m["content"]} for m in r["prompt_messages"]],
                    "metadata": json.dumps(r["metadata"], ensure_ascii=False, sort_keys=True),
                }
                for r in rows
            ],
            schema=schema,
        )
        sink = io.BytesIO()
        pq.write_table(table, sink, compression="zstd")
        return sink.getvalue()
    if not file_name(url).endswith(".jsonl"):
        raise ValueError(f"output {url!r} must end in .jsonl or .parquet")
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")


def write_rows(rows: list[Row], url: str, storage_options: Mapping[str, Any] | None) -> None:
    data = encode_rows(rows, url)
    ObjectStore(url, storage_options=storage_options, retry=RetryPolicy()).write_bytes(url, data)


def read_prepared(url: str, *, storage_options: Mapping[str, Any] | None = None) -> list[Row]:
    """The rows of a prepared data set (JSONL or Parquet), metadata decoded to dicts."""
    rows = []
    for _, record in read_parsed_records(url, storage_options=storage_options):
        if isinstance(record.get("metadata"), str):
            record["metadata"] = load_json(record["metadata"])
        rows.append(record)
    return rows
