"""Checkpoint retention: which committed checkpoints keep their files.

A checkpoint is pruned by writing its tombstone (`checkpoints/iter-<n>/<kind>/_pruned.json`:
when, why, how many bytes), then deleting its `files/`. The manifest stays, so lineage, parents
and `sdpo verify` still check every digest; reading a pruned checkpoint fails naming the rule. A
kill between the tombstone and the deletion is finished by the next prune.

Two rules, each a union of clauses (`KeepRule`; a rule with no clause keeps everything):
`resumable` for the full training state (`megatron`), `weights` for the HF policy and teacher
weights. Whatever the rules say, the files a resume or the next iteration reads are never pruned:
the base model (iteration 0: static and trust-region teachers, the trainer's config), the LATEST
policy and teacher (the next rollout and teacher) and, with a staleness k (`pipeline.max_staleness`),
the k before them (the next k+1 iterations sample from and are scored by LATEST-k .. LATEST), and the
last full training state at or before LATEST (with the teacher shards after it, which are never
pruned, it restores the trainer exactly).

`apply` decides every checkpoint from one listing of the checkpoints, which gives their sizes too
(`sdpo gc`); the flow's pass after each commit, `apply_after_commit`, decides only what can have
changed since the previous pass, so its cost does not grow with the run (`RunLayout.retention_record`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from storage.errors import NotCommittedError
from storage.layout import CHECKPOINT_KINDS, CheckpointListing, RunLayout
from storage.manifest import read_latest, read_manifest
from storage.provenance import utc_now

logger = logging.getLogger(__name__)

RESUMABLE_KINDS = ("megatron",)
_RECORD_VERSION = 1


class PrunedCheckpointError(NotCommittedError):
    """A committed checkpoint whose files retention removed."""


@dataclass(frozen=True)
class KeepRule:
    """Keep the last `last` iterations, every `every`-th, and the one with the highest `best` eval metric."""

    last: int | None = None
    every: int | None = None
    best: str | None = None

    @property
    def keeps_all(self) -> bool:
        return self.last is None and self.every is None and self.best is None


@dataclass(frozen=True)
class Decision:
    iteration: int
    kind: str
    bytes: int
    keep: bool
    reason: str


def is_pruned(layout: RunLayout, n: int, kind: str) -> bool:
    return layout.store.exists(layout.checkpoint_tombstone(n, kind))


def check_not_pruned(layout: RunLayout, n: int, kind: str) -> None:
    """Raise PrunedCheckpointError (with the tombstone's reason) when checkpoint `kind` of n was pruned."""
    url = layout.checkpoint_tombstone(n, kind)
    if layout.store.exists(url):
        stone = json.loads(layout.store.read_bytes(url))
        raise PrunedCheckpointError(
            f"checkpoint {kind} of iteration {n} was pruned at {stone['pruned_at']} ({stone['reason']}); its "
            "manifest remains, its files do not"
        )


def protected(committed: dict[str, list[int]], latest: int, *, staleness: int = 0) -> set[tuple[int, str]]:
    """What a resume or the next iterations read (see the module doc); `committed` lists, by kind,
    the committed checkpoints up to LATEST that still hold their files, ascending."""
    keep = {(0, "policy")}
    keep |= {(n, kind) for n in range(max(0, latest - staleness), latest + 1) for kind in ("policy", "teacher")}
    if committed.get("megatron"):
        keep.add((max(committed["megatron"]), "megatron"))
    return keep


def _decide(
    committed: dict[str, list[int]],
    latest: int,
    *,
    resumable: KeepRule,
    weights: KeepRule,
    eval_metric: Callable[[int, str], float | None],
    staleness: int,
    best_so_far: dict[str, tuple[float, int] | None] | None = None,
) -> tuple[list[tuple[int, str, bool, str, bool]], dict[str, tuple[float, int] | None]]:
    """(iteration, kind, keep, reason, lapses) for every checkpoint in `committed` (by kind,
    ascending: the ones still holding their files), and the best (value, iteration) per kind where a
    rule ranks. `lapses`: a keep whose reason can turn into a prune at a later LATEST under the same
    rules (needed now, among the last N, the best); no rule and every M-th cannot.

    `best_so_far` carries the best of checkpoints not listed (an incremental pass lists only the
    ones whose decision can change); the listed ones are ranked against it."""
    guard = protected(committed, latest, staleness=staleness)
    decisions = []
    bests: dict[str, tuple[float, int] | None] = {}
    for kind in CHECKPOINT_KINDS:
        rule = resumable if kind in RESUMABLE_KINDS else weights
        present = committed.get(kind, [])
        last = set(present[-rule.last :]) if rule.last else set()
        best = None
        if rule.best is not None:
            scored = [(value, n) for n in present if (value := eval_metric(n, rule.best)) is not None]
            earlier = (best_so_far or {}).get(kind)
            scored += [earlier] if earlier is not None else []
            best = max(scored) if scored else None
            bests[kind] = best
        for n in present:
            if (n, kind) in guard:
                keep, reason, lapses = True, "needed to resume or for the next iteration", True
            elif rule.keeps_all:
                keep, reason, lapses = True, "no retention rule", False
            elif n in last:
                keep, reason, lapses = True, f"among the last {rule.last}", True
            elif rule.every and n % rule.every == 0:
                keep, reason, lapses = True, f"every {rule.every}th", False
            elif best is not None and n == best[1]:
                keep, reason, lapses = True, f"best {rule.best}", True
            else:
                keep, reason, lapses = False, "outside the retention rule", False
            decisions.append((n, kind, keep, reason, lapses))
    return decisions, bests


def _size(layout: RunLayout, n: int, kind: str) -> int:
    return int(read_manifest(layout, layout.checkpoint_manifest(n, kind)).data["bytes"])


def _holding_files(inventory: dict[tuple[int, str], CheckpointListing], latest: int) -> dict[str, list[int]]:
    """By kind, ascending: the committed checkpoints up to LATEST without a tombstone."""
    committed: dict[str, list[int]] = {kind: [] for kind in CHECKPOINT_KINDS}
    for (n, kind), listing in sorted(inventory.items()):
        if n <= latest and "manifest" in listing.held and "tombstone" not in listing.held:
            committed[kind].append(n)
    return committed


def prune(layout: RunLayout, decision: Decision) -> None:
    """Tombstone first, then the files (idempotent)."""
    url = layout.checkpoint_tombstone(decision.iteration, decision.kind)
    if not layout.store.exists(url):
        stone = {"pruned_at": utc_now(), "reason": decision.reason, "bytes": decision.bytes}
        layout.store.write_bytes(url, (json.dumps(stone, sort_keys=True) + "\n").encode())
    layout.store.remove_tree(layout.checkpoint_files_dir(decision.iteration, decision.kind))
    logger.info(
        "pruned checkpoint %s of iteration %d (%d bytes): %s",
        decision.kind,
        decision.iteration,
        decision.bytes,
        decision.reason,
    )


def finish_interrupted_prunes(layout: RunLayout, inventory: dict[tuple[int, str], CheckpointListing]) -> None:
    """Delete the files of checkpoints whose tombstone exists (a prune killed half-way)."""
    for (n, kind), listing in sorted(inventory.items()):
        if {"tombstone", "files"} <= listing.held:
            layout.store.remove_tree(layout.checkpoint_files_dir(n, kind))


def apply(
    layout: RunLayout,
    *,
    resumable: KeepRule,
    weights: KeepRule,
    eval_metric: Callable[[int, str], float | None],
    dry_run: bool = False,
    staleness: int = 0,
) -> list[Decision]:
    """Plan every checkpoint and (unless `dry_run`) finish interrupted prunes, prune, and record where
    the pass left off for the next `apply_after_commit`; returns the plan."""
    latest = read_latest(layout)
    if latest is None:
        return []
    inventory = layout.checkpoint_inventory()
    committed = _holding_files(inventory, latest)
    decided, bests = _decide(
        committed, latest, resumable=resumable, weights=weights, eval_metric=eval_metric, staleness=staleness
    )
    # sizes from the listing: a manifest read per checkpoint would be a request each on S3
    decisions = [Decision(n, kind, inventory[n, kind].bytes, keep, reason) for n, kind, keep, reason, _ in decided]
    if not dry_run:
        finish_interrupted_prunes(layout, inventory)
        for decision in decisions:
            if not decision.keep:
                prune(layout, decision)
        _write_record(layout, _rules(resumable, weights, staleness), latest, decided, bests)
    return decisions


def apply_after_commit(
    layout: RunLayout,
    *,
    resumable: KeepRule,
    weights: KeepRule,
    eval_metric: Callable[[int, str], float | None],
    staleness: int = 0,
) -> list[Decision]:
    """The pass after a commit: `apply`'s decisions, looking only at what can have changed since the
    previous pass; returns the prunes it made.

    A checkpoint kept for a reason that does not lapse (no rule, every M-th) stays kept, and a
    pruned one stays pruned, so the pass takes up the checkpoints committed since the previous pass
    and those the previous pass kept for a reason that can lapse (needed to resume, among the last
    N, the best), with the best value so far (`RunLayout.retention_record`). Its store operations
    are a handful per iteration however long the run, where a full pass reads every checkpoint's
    manifest and tombstone. Without a record, or with one written under other rules or past LATEST,
    it makes a full pass (`apply`). The record is written after the prunes, so a pass killed
    half-way is made again from the same record, and pruning is idempotent.

    An evaluation written for an iteration after the pass that followed its commit (`sdpo eval
    --iteration`) is ranked by the next full pass (`sdpo gc`); until then the rule keeps the best it
    knew, which errs on keeping.
    """
    latest = read_latest(layout)
    if latest is None:
        return []
    rules = _rules(resumable, weights, staleness)
    record = _read_record(layout)
    if record is None or record["rules"] != rules or record["through"] > latest:
        return [
            d
            for d in apply(layout, resumable=resumable, weights=weights, eval_metric=eval_metric, staleness=staleness)
            if not d.keep
        ]
    through = record["through"]
    if through == latest:
        return []
    # a full state saved in the background lands after its own iteration's commit, named by the next
    # iteration's train stage: the pass after that commit takes up the iteration before it as well
    first = {
        kind: through if kind in RESUMABLE_KINDS and not is_pruned(layout, through, kind) else through + 1
        for kind in CHECKPOINT_KINDS
    }
    committed = {
        kind: sorted(
            set(record["pending"][kind])
            | {n for n in range(first[kind], latest + 1) if layout.store.exists(layout.checkpoint_manifest(n, kind))}
        )
        for kind in CHECKPOINT_KINDS
    }
    best_so_far = {kind: (best[0], best[1]) if best else None for kind, best in record["best"].items()}
    decided, bests = _decide(
        committed,
        latest,
        resumable=resumable,
        weights=weights,
        eval_metric=eval_metric,
        staleness=staleness,
        best_so_far=best_so_far,
    )
    prunes = [
        Decision(n, kind, _size(layout, n, kind), keep, reason) for n, kind, keep, reason, _ in decided if not keep
    ]
    for decision in prunes:
        prune(layout, decision)
    _write_record(layout, rules, latest, decided, bests)
    return prunes


def _rules(resumable: KeepRule, weights: KeepRule, staleness: int) -> dict[str, Any]:
    return {"resumable": asdict(resumable), "weights": asdict(weights), "staleness": staleness}


def _read_record(layout: RunLayout) -> dict[str, Any] | None:
    url = layout.retention_record
    if not layout.store.exists(url):
        return None
    record: dict[str, Any] = json.loads(layout.store.read_bytes(url))
    if record.get("version") != _RECORD_VERSION:
        return None  # written by another version: a full pass writes this one's
    return record


def _write_record(
    layout: RunLayout,
    rules: dict[str, Any],
    latest: int,
    decided: list[tuple[int, str, bool, str, bool]],
    bests: dict[str, tuple[float, int] | None],
) -> None:
    pending: dict[str, list[int]] = {kind: [] for kind in CHECKPOINT_KINDS}
    for n, kind, keep, _, lapses in decided:
        if keep and lapses:
            pending[kind].append(n)
    record = {
        "version": _RECORD_VERSION,
        "rules": rules,
        "through": latest,
        "pending": pending,
        "best": {kind: list(best) if best else None for kind, best in bests.items()},
    }
    layout.store.write_bytes(layout.retention_record, (json.dumps(record, sort_keys=True) + "\n").encode())
