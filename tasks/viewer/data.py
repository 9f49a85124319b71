"""The viewer's data access: which iterations a run has, and one index per iteration for the list.

An iteration's samples are its `teacher` shards when that stage is committed (rollout columns plus
the teacher's), else its `rollout` shards. The index is one pass over the light columns (no top-K
columns), kept in memory; sorting, filters, search and paging run on it, so a page costs the same
for 20k samples as for 20. Everything is read through `storage/`.

Divergence of a sample: the mean over its response tokens of `sampled_logprobs -
teacher_sampled_logprobs`, the sampled-token estimate of KL(student || teacher); its negation per
token is the credit the page colours (see `tasks.viewer.render`).

Route (SRPO runs): the branch of the loss the teacher stage sent the sample to, "sdpo" or "grpo".
The entropy weight of one of its SDPO tokens is exp(-beta * H) over the iteration's mean of
exp(-beta * H) on all SDPO tokens, H the teacher's entropy: the weight the trainer applied when one
optimizer step took the whole iteration (with more steps, each step normalises over its own
mini-batch, so the trained weights differ from these by one factor per step).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from storage.layout import RunLayout
from tasks.runtime import Run, open_run

logger = logging.getLogger(__name__)

SortKey = Literal["sample_id", "reward", "length", "divergence"]
MaskFilter = Literal["all", "trained", "masked"]
RouteFilter = Literal["all", "sdpo", "grpo"]
SORT_KEYS: tuple[str, ...] = ("sample_id", "reward", "length", "divergence")
MAX_PAGE = 500
PREVIEW_CHARS = 160
_CACHED_ITERATIONS = 4
_ROLLOUT_INDEX = (
    "sample_id",
    "group_id",
    "prompt_id",
    "reward",
    "finish_reason",
    "format_error",
    "data_source",
    "label",
    "feedback",
    "response_text",
    "prompt_messages",
    "sampled_logprobs",
)
_TEACHER_INDEX = ("teacher_sampled_logprobs", "sample_mask", "teacher_source", "route")
_SRPO_INDEX = ("teacher_entropy",)  # for the entropy weights' norm, read for SRPO runs only


class NotFoundError(LookupError):
    """An iteration, sample or group the run does not have."""


class BadQueryError(ValueError):
    """A list query that cannot be answered (bad values, or a mask filter before the teacher stage)."""


@dataclass(frozen=True)
class IterationIndex:
    """The light columns of every sample of one iteration, [N] each, in shard order."""

    iteration: int
    stage: str  # "teacher" or "rollout"
    sample_id: np.ndarray
    group_id: np.ndarray
    reward: np.ndarray
    length: np.ndarray
    format_error: np.ndarray
    mask: np.ndarray | None  # None before the teacher stage
    divergence: np.ndarray  # NaN before the teacher stage and for empty responses
    data_source: np.ndarray
    finish_reason: np.ndarray
    teacher_source: np.ndarray | None
    route: np.ndarray | None  # "sdpo" / "grpo" per sample (SRPO), None entries when the loss does not route
    entropy_weight_norm: float | None  # SRPO: the iteration's mean exp(-beta H) over its SDPO tokens
    preview: list[str]
    search_text: list[str]  # lower-cased prompt, response, label and feedback
    shard: np.ndarray
    row: np.ndarray
    position: dict[int, int]  # sample_id -> index

    @property
    def scored(self) -> bool:
        return self.mask is not None

    def rows_of_group(self, group_id: int) -> np.ndarray:
        rows = np.flatnonzero(self.group_id == group_id)
        if rows.size == 0:
            raise NotFoundError(f"iteration {self.iteration} has no group {group_id}")
        return rows

    def index_of(self, sample_id: int) -> int:
        if sample_id not in self.position:
            raise NotFoundError(f"iteration {self.iteration} has no sample {sample_id}")
        return self.position[sample_id]


def _strings(table: pa.Table, name: str) -> np.ndarray:
    return np.asarray(table.column(name).to_pylist(), dtype=object)


def _flat(table: pa.Table, name: str) -> np.ndarray:
    return pc.list_flatten(table.column(name)).to_numpy(zero_copy_only=False).astype(np.float64)


def _per_row_mean(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[N] means of consecutive runs of `lengths` values; NaN for empty rows."""
    ends = np.cumsum(lengths)
    totals = np.concatenate([[0.0], np.cumsum(values)])
    sums = totals[ends] - totals[ends - lengths]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(lengths > 0, sums / lengths, np.nan)


def build_index(table: pa.Table, *, iteration: int, stage: str, srpo_beta: float | None) -> IterationIndex:
    """The index of one stage's rows (`read_index` output with the `_ROLLOUT_INDEX` columns and, for
    a teacher stage, the `_TEACHER_INDEX` ones, and `_SRPO_INDEX` with `srpo_beta`, the run's SRPO
    beta: None for other losses), for the entropy weights' norm."""
    from storage.lookup import ROW_COLUMN, SHARD_COLUMN

    lengths = pc.list_value_length(table.column("sampled_logprobs")).to_numpy(zero_copy_only=False).astype(np.int64)
    scored = stage == "teacher"
    route, norm = None, None
    if scored:
        divergence = _per_row_mean(_flat(table, "sampled_logprobs") - _flat(table, "teacher_sampled_logprobs"), lengths)
        route = _strings(table, "route")
        if srpo_beta is not None:
            sdpo_tokens = np.repeat(route == "sdpo", lengths)
            weights = np.exp(-srpo_beta * _flat(table, "teacher_entropy")[sdpo_tokens])
            norm = float(weights.mean()) if weights.size else None
    else:
        divergence = np.full(lengths.size, np.nan)
    responses = table.column("response_text").to_pylist()
    prompts = [" ".join(m["content"] for m in messages) for messages in table.column("prompt_messages").to_pylist()]
    labels = table.column("label").to_pylist()
    feedback = table.column("feedback").to_pylist()
    search = [
        f"{p}\n{r}\n{lab}\n{f or ''}".lower() for p, r, lab, f in zip(prompts, responses, labels, feedback, strict=True)
    ]
    sample_id = table.column("sample_id").to_numpy()
    return IterationIndex(
        iteration=iteration,
        stage=stage,
        sample_id=sample_id,
        group_id=table.column("group_id").to_numpy(),
        reward=table.column("reward").to_numpy().astype(np.float64),
        length=lengths,
        format_error=table.column("format_error").to_numpy(zero_copy_only=False),
        mask=table.column("sample_mask").to_numpy(zero_copy_only=False) if scored else None,
        divergence=divergence,
        data_source=_strings(table, "data_source"),
        finish_reason=_strings(table, "finish_reason"),
        teacher_source=_strings(table, "teacher_source") if scored else None,
        route=route,
        entropy_weight_norm=norm,
        preview=[r[:PREVIEW_CHARS] for r in responses],
        search_text=search,
        shard=table.column(SHARD_COLUMN).to_numpy(),
        row=table.column(ROW_COLUMN).to_numpy(),
        position={int(s): i for i, s in enumerate(sample_id.tolist())},
    )


@dataclass(frozen=True, kw_only=True)
class Query:
    """One page request of the sample list."""

    sort: SortKey = "sample_id"
    descending: bool = False
    reward_min: float | None = None
    reward_max: float | None = None
    mask: MaskFilter = "all"
    route: RouteFilter = "all"
    data_source: str | None = None
    finish_reason: str | None = None
    search: str | None = None
    offset: int = 0
    limit: int = 50

    def __post_init__(self) -> None:
        if self.sort not in SORT_KEYS:
            raise BadQueryError(f"sort must be one of {SORT_KEYS}, got {self.sort!r}")
        if self.mask not in ("all", "trained", "masked"):
            raise BadQueryError(f"mask must be 'all', 'trained' or 'masked', got {self.mask!r}")
        if self.route not in ("all", "sdpo", "grpo"):
            raise BadQueryError(f"route must be 'all', 'sdpo' or 'grpo', got {self.route!r}")
        if self.offset < 0 or not 1 <= self.limit <= MAX_PAGE:
            raise BadQueryError(
                f"need offset >= 0 and 1 <= limit <= {MAX_PAGE}, got offset={self.offset}, limit={self.limit}"
            )


def select(index: IterationIndex, query: Query) -> np.ndarray:
    """Positions in `index` of the samples `query` keeps, in its order (ties by sample_id)."""
    keep = np.ones(index.sample_id.size, dtype=bool)
    if query.reward_min is not None:
        keep &= index.reward >= query.reward_min
    if query.reward_max is not None:
        keep &= index.reward <= query.reward_max
    if query.mask != "all":
        if index.mask is None:
            raise BadQueryError(f"iteration {index.iteration} is not scored by the teacher yet: it has no sample mask")
        keep &= index.mask if query.mask == "trained" else ~index.mask
    if query.route != "all":
        if index.route is None:
            raise BadQueryError(f"iteration {index.iteration} is not scored by the teacher yet: it has no routes")
        keep &= index.route == query.route
    if query.data_source is not None:
        keep &= index.data_source == query.data_source
    if query.finish_reason is not None:
        keep &= index.finish_reason == query.finish_reason
    if query.search:
        needle = query.search.lower()
        keep &= np.fromiter((needle in text for text in index.search_text), dtype=bool, count=keep.size)
    rows = np.flatnonzero(keep)
    key = {
        "sample_id": index.sample_id,
        "reward": index.reward,
        "length": index.length,
        "divergence": index.divergence,
    }[query.sort][rows].astype(np.float64)
    if query.descending:
        key = -key
    key = np.where(np.isnan(key), np.inf, key)  # unscored samples last in either direction
    return rows[np.lexsort((index.sample_id[rows], key))]


def _number(value: float) -> float | None:
    return None if not np.isfinite(value) else round(float(value), 6)


def list_row(index: IterationIndex, i: int) -> dict[str, Any]:
    """What the sample list shows of sample `i`."""
    return {
        "sample_id": int(index.sample_id[i]),
        "group_id": int(index.group_id[i]),
        "reward": _number(index.reward[i]),
        "length": int(index.length[i]),
        "mask": None if index.mask is None else bool(index.mask[i]),
        "divergence": _number(index.divergence[i]),
        "data_source": index.data_source[i],
        "finish_reason": index.finish_reason[i],
        "teacher_source": None if index.teacher_source is None else index.teacher_source[i],
        "route": None if index.route is None else index.route[i],
        "preview": index.preview[i],
    }


def page(index: IterationIndex, query: Query) -> dict[str, Any]:
    """{"total": matches, "offset", "limit", "rows": [list_row]} of one page."""
    rows = select(index, query)
    chosen = rows[query.offset : query.offset + query.limit]
    return {
        "total": int(rows.size),
        "offset": query.offset,
        "limit": query.limit,
        "rows": [list_row(index, int(i)) for i in chosen],
    }


def _fraction(values: np.ndarray) -> float | None:
    return _number(float(np.mean(values))) if values.size else None


def _routed_fraction(index: IterationIndex) -> float | None:
    """The share of samples routed to SDPO; None before the teacher stage or when nothing is routed."""
    if index.route is None or all(r is None for r in index.route):
        return None
    return _fraction(index.route == "sdpo")


def summary(index: IterationIndex) -> dict[str, Any]:
    """Per-iteration aggregates shown above the list, and the filter choices."""
    sources, source_counts = np.unique(index.data_source.astype(str), return_counts=True)
    reasons, reason_counts = np.unique(index.finish_reason.astype(str), return_counts=True)
    scored = index.divergence[np.isfinite(index.divergence)]
    return {
        "iteration": index.iteration,
        "stage": index.stage,
        "samples": int(index.sample_id.size),
        "groups": int(np.unique(index.group_id).size),
        "reward_mean": _fraction(index.reward),
        "accuracy": _fraction(index.reward >= 1.0),
        "format_error_fraction": _fraction(index.format_error.astype(bool)),
        "truncated_fraction": _fraction(index.finish_reason == "length"),
        "response_length_mean": _fraction(index.length),
        "trained_fraction": None if index.mask is None else _fraction(index.mask.astype(bool)),
        "routed_sdpo_fraction": _routed_fraction(index),
        "divergence_mean": _fraction(scored),
        "data_sources": dict(zip(sources.tolist(), source_counts.tolist(), strict=True)),
        "finish_reasons": dict(zip(reasons.tolist(), reason_counts.tolist(), strict=True)),
    }


class RunData:
    """One run opened read-only: its config, its iterations and their cached indexes."""

    def __init__(self, root: str, run_name: str) -> None:
        self.run: Run = open_run(root, run_name)
        self._indexes: OrderedDict[int, IterationIndex] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def layout(self) -> RunLayout:
        return self.run.layout

    def stage_of(self, n: int) -> str:
        """The stage whose shards hold iteration n's samples; fails when neither is committed."""
        from storage.manifest import stage_done

        for stage in ("teacher", "rollout"):
            if stage_done(self.layout, n, stage):
                return stage
        raise NotFoundError(f"iteration {n} of run {self.layout.run_name!r} has no committed rollout")

    def iterations(self) -> list[dict[str, Any]]:
        """[{iteration, stage, samples, committed}] of every iteration with a committed rollout."""
        from storage.manifest import iteration_committed, read_stage_manifest, stage_done

        out = []
        for n in self.layout.iterations():
            if not stage_done(self.layout, n, "rollout"):
                continue
            stage = self.stage_of(n)
            rows = read_stage_manifest(self.layout, n, stage).data["rows"]
            out.append(
                {"iteration": n, "stage": stage, "samples": rows, "committed": iteration_committed(self.layout, n)}
            )
        return out

    def index(self, n: int) -> IterationIndex:
        """The (cached) index of iteration n; rebuilt when its teacher stage got committed since."""
        from storage.lookup import read_index

        with self._lock:
            stage = self.stage_of(n)
            cached = self._indexes.get(n)
            if cached is not None and cached.stage == stage:
                self._indexes.move_to_end(n)
                return cached
            cfg = self.run.cfg
            beta = cfg.loss.srpo.beta if cfg.loss.type == "srpo" else None
            columns: tuple[str, ...] = _ROLLOUT_INDEX
            if stage == "teacher":
                columns += _TEACHER_INDEX + (_SRPO_INDEX if beta is not None else ())
            table = read_index(self.layout, n, stage, columns=columns, verify=cfg.storage.verify_sha256)
            index = build_index(table, iteration=n, stage=stage, srpo_beta=beta)
            self._indexes[n] = index
            while len(self._indexes) > _CACHED_ITERATIONS:
                self._indexes.popitem(last=False)
            logger.info("indexed iteration %d (%s): %d samples", n, stage, index.sample_id.size)
            return index

    def read_samples(self, n: int, positions: np.ndarray, *, columns: tuple[str, ...] | None = None) -> pa.Table:
        """Full rows (or `columns`) of the samples at index positions `positions`, in that order."""
        from storage.lookup import read_rows

        index = self.index(n)
        pairs = [(int(index.shard[i]), int(index.row[i])) for i in positions]
        return read_rows(self.layout, n, index.stage, pairs, columns=columns)
