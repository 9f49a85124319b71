"""Parquet schemas of stage shards, defined once and versioned. One row = one sampled response.

Per-token top-K layout: `topk_ids` is `list<fixed_size_list<int32, K>>` and `topk_logprobs`
`list<fixed_size_list<float32|float16, K>>`: one K-vector per response token, candidates sorted by
the student's logprob, descending. K is fixed per shard: it is part of the column type and also
stored in the schema metadata (`sdpo.top_k`). Parquet writes them with BYTE_STREAM_SPLIT + zstd
(see `storage.shard_writer.parquet_options`); docs/storage.md has the measurements behind this choice.
Readers get values [N_tokens, K] plus per-row token offsets (`storage.shard_columns.topk`).

A teacher shard extends the rollout's rows (`ShardSchema.extends`): it stores the teacher stage's
own columns and `sample_id`, row for row in the rollout stage's order, and readers get the rollout's
columns joined to them (`storage.shard_reader`). A reader sees `ShardSchema.view`: the rollout's
columns, then the teacher's.

Invariants (checked by `check_rows` on every write):
- non-nullable columns have no nulls; `finish_reason` is "stop" or "length"; `iteration` equals the
  iteration being written; ids are >= 0;
- per row T = len(response_ids) = len(sampled_logprobs) = len(topk_ids) = len(topk_logprobs), each
  top-K entry holding exactly K values;
- teacher shards: `sample_id` equals the rollout's at the same row, and len(teacher_sampled_logprobs) =
  len(teacher_topk_logprobs) = len(teacher_entropy) = the rollout row's T (teacher logprobs of the
  student's topk_ids, same order; the teacher's entropy at each response position); `route` is null,
  "sdpo" or "grpo"; `pass_rate` is in [0, 1];
- logprob values are not NaN and <= 1e-3 (rounding slack above 0); -inf is allowed; entropies are
  finite and >= -1e-3 (rounding slack below 0); `reward` and `advantage` are finite;
- prompt_messages are lists of {"role": str, "content": str} dicts, nothing else;
- sample_id is unique within a stage (checked by the writer across shards).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from storage.errors import SchemaVersionError, ShardInvariantError

ColumnKind = Literal[
    "int64",
    "int32",
    "float32",
    "string",
    "bool",
    "tokens",
    "logprobs",
    "entropies",
    "topk_ids",
    "topk_logprobs",
    "messages",
]
PER_TOKEN_KINDS = ("logprobs", "entropies", "topk_ids", "topk_logprobs")  # one entry per response token
LogprobDtype = Literal["float32", "float16"]
LOGPROB_DTYPES: tuple[LogprobDtype, ...] = ("float32", "float16")
FINISH_REASONS = ("stop", "length")
LOGPROB_MAX = 1e-3  # log-probabilities above this are corrupt, not rounding
ENTROPY_MIN = -1e-3  # entropies below this are corrupt, not rounding
ROUTES = ("sdpo", "grpo")  # the values of the teacher shard's `route` column (null: the loss does not route)
JOIN_KEY = "sample_id"  # the column a shard that extends another stage's rows repeats, checked row for row

META_SCHEMA = b"sdpo.schema"
META_VERSION = b"sdpo.schema_version"
META_TOP_K = b"sdpo.top_k"
META_LOGPROB_DTYPE = b"sdpo.logprob_dtype"
META_TOPK_LAYOUT = b"sdpo.topk_layout"
TOPK_LAYOUT = "list<fixed_size_list<K>>"

_MESSAGE = pa.struct([pa.field("role", pa.string(), nullable=False), pa.field("content", pa.string(), nullable=False)])


@dataclass(frozen=True)
class Column:
    name: str
    kind: ColumnKind
    nullable: bool
    doc: str

    def arrow_type(self, *, top_k: int, logprob_dtype: LogprobDtype) -> pa.DataType:
        scalar = {
            "int64": pa.int64(),
            "int32": pa.int32(),
            "float32": pa.float32(),
            "string": pa.string(),
            "bool": pa.bool_(),
        }
        if self.kind in scalar:
            return scalar[self.kind]
        logprob = pa.float16() if logprob_dtype == "float16" else pa.float32()
        if self.kind in ("topk_ids", "topk_logprobs"):
            item = pa.int32() if self.kind == "topk_ids" else logprob
            per_token = pa.list_(pa.field("element", item, nullable=False), top_k)
            return pa.list_(pa.field("element", per_token, nullable=False))
        item = {"tokens": pa.int32(), "logprobs": pa.float32(), "entropies": pa.float32(), "messages": _MESSAGE}[
            self.kind
        ]
        return pa.list_(pa.field("element", item, nullable=False))


ROLLOUT_COLUMNS: tuple[Column, ...] = (
    Column("sample_id", "int64", False, "unique per iteration; one sampled response"),
    Column("group_id", "int64", False, "the G samples of one prompt share it"),
    Column("prompt_id", "string", False, "stable id of the prompt in its data set"),
    Column("iteration", "int32", False, "iteration n that sampled it"),
    Column("prompt_messages", "messages", False, "chat messages [{role, content}] given to the policy"),
    Column("prompt_ids", "tokens", False, "chat-templated prompt token ids"),
    Column("response_ids", "tokens", False, "sampled response token ids, T per row"),
    Column("response_text", "string", False, "detokenised response"),
    Column("sampled_logprobs", "logprobs", False, "[T] engine logprob of each sampled token (float32)"),
    Column("topk_ids", "topk_ids", False, "[T][K] student top-K ids per response token"),
    Column("topk_logprobs", "topk_logprobs", False, "[T][K] student logprobs of topk_ids, descending"),
    Column("finish_reason", "string", False, "'stop' or 'length'"),
    Column("reward", "float32", False, "verifier reward"),
    Column("feedback", "string", True, "verifier feedback text, if any"),
    Column("format_error", "bool", False, "the verifier found the answer malformed (not merely wrong)"),
    Column("label", "string", False, "reference answer given to the verifier"),
    Column("data_source", "string", False, "data set / verifier name"),
    Column("teacher_prompt", "string", True, "privileged prompt from the data (OPSD), if any"),
    Column("extra_json", "string", False, "free metadata as a JSON object"),
)

TEACHER_COLUMNS: tuple[Column, ...] = (
    Column(JOIN_KEY, "int64", False, "the rollout row this row extends: the rollout's sample_id at the same position"),
    Column("teacher_prompt_ids", "tokens", False, "chat-templated teacher prompt ids; scored as prompt + response_ids"),
    Column("teacher_prompt_text", "string", False, "the teacher prompt text"),
    Column("teacher_source", "string", False, "what the teacher saw: e.g. demo, feedback, data, none"),
    Column("sample_mask", "bool", False, "False: no usable teacher signal, excluded from the loss"),
    Column("teacher_topk_logprobs", "topk_logprobs", False, "[T][K] teacher logprobs of the student's topk_ids"),
    Column("teacher_sampled_logprobs", "logprobs", False, "[T] teacher logprob of each sampled token"),
    Column("advantage", "float32", False, "per-sample advantage decided upstream (e.g. GRPO group-normalised reward)"),
    Column(
        "route", "string", True, "SRPO's branch for the sample, 'sdpo' or 'grpo'; null when the loss does not route"
    ),
    Column(
        "pass_rate", "float32", False, "share of the sample's group with a reward at the success threshold or above"
    ),
    Column(
        "teacher_entropy", "entropies", False, "[T] teacher's next-token entropy, full vocabulary, nats (0: unscored)"
    ),
)


@dataclass(frozen=True)
class ShardSchema:
    """A named, versioned column list. Bump `version` on any change of columns or layout.

    `columns` are the ones its files store. A schema that `extends` another stores, besides its own
    columns, only `JOIN_KEY`: its rows are the extended stage's (the stage named like that schema)
    of the same iteration, in the same order, and a reader sees both (`view`).
    """

    name: str
    version: int
    columns: tuple[Column, ...]
    extends: ShardSchema | None = None

    def __post_init__(self) -> None:
        if self.extends is not None and JOIN_KEY not in self.names:
            raise ValueError(f"{self.name} schema extends {self.extends.name} rows but stores no {JOIN_KEY!r}")

    @property
    def names(self) -> tuple[str, ...]:
        """The columns its files store."""
        return tuple(c.name for c in self.columns)

    @property
    def view(self) -> tuple[Column, ...]:
        """The columns a reader sees: those of the schema it extends, then its own (the key once)."""
        if self.extends is None:
            return self.columns
        return self.extends.columns + tuple(c for c in self.columns if c.name != JOIN_KEY)

    @property
    def view_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.view)

    def column(self, name: str) -> Column:
        for c in self.view:
            if c.name == name:
                return c
        raise KeyError(f"{self.name} schema v{self.version} has no column {name!r}; columns: {self.view_names}")

    def arrow(self, *, top_k: int, logprob_dtype: LogprobDtype = "float32") -> pa.Schema:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        if logprob_dtype not in LOGPROB_DTYPES:
            raise ValueError(f"logprob_dtype must be one of {LOGPROB_DTYPES}, got {logprob_dtype!r}")
        fields = [
            pa.field(c.name, c.arrow_type(top_k=top_k, logprob_dtype=logprob_dtype), nullable=c.nullable)
            for c in self.columns
        ]
        metadata = {
            META_SCHEMA: self.name.encode(),
            META_VERSION: str(self.version).encode(),
            META_TOP_K: str(top_k).encode(),
            META_LOGPROB_DTYPE: logprob_dtype.encode(),
            META_TOPK_LAYOUT: TOPK_LAYOUT.encode(),
        }
        return pa.schema(fields, metadata=metadata)

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "version": self.version}


ROLLOUT = ShardSchema("rollout", 1, ROLLOUT_COLUMNS)
TEACHER = ShardSchema("teacher", 3, TEACHER_COLUMNS, extends=ROLLOUT)
SCHEMAS = {s.name: s for s in (ROLLOUT, TEACHER)}
STAGE_SCHEMAS = {"rollout": ROLLOUT, "teacher": TEACHER}  # stages whose shards must have this schema
# What changed in versions this code no longer reads, and what to do with files written in them
RETIRED = {
    ("teacher", 1): "teacher schema v1 lacked route, pass_rate and teacher_entropy",
    ("teacher", 2): "teacher schema v2 stored every rollout column again in each teacher shard; from v3 a "
    "teacher shard holds the teacher stage's columns alone and readers join the rollout's",
}
RETIRED_ADVICE = (
    "read or resume that run with the code that wrote it (its manifests record the code version), "
    "or start a new run with this code"
)


def version_mismatch(where: str, name: str, version: int, expected: ShardSchema) -> str:
    """Why `where`, written with `name` schema v`version`, is refused, and what to do when that
    version is retired."""
    message = (
        f"{where} was written with {name} schema v{version}; this code reads {expected.name} schema v{expected.version}"
    )
    if (name, version) in RETIRED:
        message += f" ({RETIRED[name, version]}): {RETIRED_ADVICE}"
    return message


@dataclass(frozen=True)
class ShardFormat:
    """What a shard's schema metadata says about it."""

    schema: str
    version: int
    top_k: int
    logprob_dtype: LogprobDtype


def shard_format(arrow_schema: pa.Schema, *, where: str) -> ShardFormat:
    meta = arrow_schema.metadata or {}
    missing = [k.decode() for k in (META_SCHEMA, META_VERSION, META_TOP_K, META_LOGPROB_DTYPE) if k not in meta]
    if missing:
        raise SchemaVersionError(f"{where} carries no sdpo schema metadata (missing {missing}); not a stage shard")
    return ShardFormat(
        schema=meta[META_SCHEMA].decode(),
        version=int(meta[META_VERSION]),
        top_k=int(meta[META_TOP_K]),
        logprob_dtype=meta[META_LOGPROB_DTYPE].decode(),
    )


def check_shard_schema(expected: ShardSchema, arrow_schema: pa.Schema, *, where: str) -> ShardFormat:
    """Fail unless the file was written with exactly `expected` (name and version)."""
    fmt = shard_format(arrow_schema, where=where)
    if (fmt.schema, fmt.version) != (expected.name, expected.version):
        raise SchemaVersionError(version_mismatch(where, fmt.schema, fmt.version, expected))
    want = expected.arrow(top_k=fmt.top_k, logprob_dtype=fmt.logprob_dtype)
    got = pa.schema(list(arrow_schema))
    if not got.equals(pa.schema(list(want))):
        raise SchemaVersionError(
            f"{where} claims {fmt.schema} schema v{fmt.version} but its columns differ:\n got {got}\n want {want}"
        )
    return fmt


# -- invariants ------------------------------------------------------------------------------
def row_lengths(column: pa.Array) -> np.ndarray:
    """[N] int64 list lengths of a list column."""
    lengths: np.ndarray = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
    return lengths


def _fail(schema: ShardSchema, message: str, rows: np.ndarray) -> None:
    raise ShardInvariantError(f"{schema.name} rows {rows[:5].tolist()}{'...' if rows.size > 5 else ''}: {message}")


def check_rows(
    schema: ShardSchema, table: pa.Table, *, top_k: int, iteration: int, response_lengths: np.ndarray | None = None
) -> None:
    """Vectorised check of the invariants in this module's docstring (no per-row Python loop).

    A schema without `response_ids` (one that extends the rollout's rows) is checked against
    `response_lengths`, [N] len(response_ids) of the rows it extends."""
    for c in schema.columns:
        if not c.nullable and table.column(c.name).null_count:
            nulls = np.flatnonzero(table.column(c.name).is_null().to_numpy(zero_copy_only=False))
            _fail(schema, f"null in non-nullable column {c.name!r}", nulls)
    if "iteration" in schema.names:
        iters = table.column("iteration").to_numpy()
        if (bad := np.flatnonzero(iters != iteration)).size:
            _fail(schema, f"iteration is {iters[bad[0]]}, writing iteration {iteration}", bad)
    if "finish_reason" in schema.names:
        reasons = table.column("finish_reason")
        if (bad := np.flatnonzero(~pc.is_in(reasons, pa.array(FINISH_REASONS)).to_numpy(zero_copy_only=False))).size:
            _fail(schema, f"finish_reason {reasons[int(bad[0])].as_py()!r} not in {FINISH_REASONS}", bad)

    if "response_ids" in schema.names:
        t = row_lengths(table.column("response_ids"))  # [N] tokens per response
    elif response_lengths is None:
        raise ValueError(f"{schema.name} shards store no response_ids: pass the response_lengths of their rows")
    else:
        t = response_lengths
    for c in schema.columns:
        if c.kind not in PER_TOKEN_KINDS:
            continue
        got = row_lengths(table.column(c.name))
        if (bad := np.flatnonzero(got != t)).size:
            i = bad[0]
            _fail(schema, f"len({c.name}) = {got[i]} but len(response_ids) = {t[i]}", bad)

    for c in schema.columns:
        if c.kind in ("int64", "int32", "tokens", "topk_ids"):
            values = _values(table.column(c.name))
            if values.size and values.min() < 0:
                rows = _rows_where(table.column(c.name), values < 0)
                _fail(schema, f"negative value {values.min()} in {c.name!r}", rows)
        if c.kind == "float32":
            values = _values(table.column(c.name))
            if not np.isfinite(values).all():
                _fail(schema, f"{c.name!r} is not finite", np.flatnonzero(~np.isfinite(values)))
        if c.kind in ("logprobs", "topk_logprobs"):
            values = _values(table.column(c.name))
            bad_values = np.isnan(values) | (values > LOGPROB_MAX)
            if bad_values.any():
                rows = _rows_where(table.column(c.name), bad_values)
                _fail(schema, f"{c.name!r} holds NaN or a value > {LOGPROB_MAX}", rows)
        if c.kind == "entropies":
            values = _values(table.column(c.name))
            bad_values = ~np.isfinite(values) | (values < ENTROPY_MIN)
            if bad_values.any():
                rows = _rows_where(table.column(c.name), bad_values)
                _fail(schema, f"{c.name!r} holds a non-finite value or one < {ENTROPY_MIN}", rows)
    if "route" in schema.names:
        routes = table.column("route")
        known = pc.or_kleene(pc.is_null(routes), pc.is_in(routes, pa.array(ROUTES))).to_numpy(zero_copy_only=False)
        if (bad := np.flatnonzero(~known)).size:
            _fail(schema, f"route {routes[int(bad[0])].as_py()!r} not in {ROUTES} (or null)", bad)
    if "pass_rate" in schema.names:
        rates = table.column("pass_rate").to_numpy()
        if (bad := np.flatnonzero(~((rates >= 0) & (rates <= 1)))).size:
            _fail(schema, f"pass_rate {rates[bad[0]]} is outside [0, 1]", bad)


def _leaves(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(leaf values, [N] leaf count per row) of a scalar, list or list<fixed_size_list> column."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    counts = np.ones(len(array), dtype=np.int64)
    if pa.types.is_list(array.type):
        counts = row_lengths(array)
        array = array.flatten()
        if pa.types.is_fixed_size_list(array.type):
            counts = counts * array.type.list_size
            array = array.flatten()
    return array.to_numpy(zero_copy_only=False), counts


def _values(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    return _leaves(column)[0]


def _rows_where(column: pa.ChunkedArray | pa.Array, bad_values: np.ndarray) -> np.ndarray:
    _, counts = _leaves(column)
    row_of_value = np.repeat(np.arange(counts.size), counts)
    return np.unique(row_of_value[bad_values])
