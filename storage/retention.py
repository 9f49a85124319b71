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
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from storage.errors import NotCommittedError
from storage.layout import CHECKPOINT_KINDS, RunLayout
from storage.manifest import read_latest, read_manifest
from storage.provenance import utc_now

logger = logging.getLogger(__name__)

RESUMABLE_KINDS = ("megatron",)


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


def _committed(layout: RunLayout, kind: str, latest: int) -> list[int]:
    return [
        n
        for n in layout.checkpoint_iterations()
        if n <= latest and layout.store.exists(layout.checkpoint_manifest(n, kind))
    ]


def protected(layout: RunLayout, latest: int, *, staleness: int = 0) -> set[tuple[int, str]]:
    """What a resume or the next iterations read (see the module doc)."""
    keep = {(0, "policy")}
    keep |= {(n, kind) for n in range(max(0, latest - staleness), latest + 1) for kind in ("policy", "teacher")}
    full = [n for n in _committed(layout, "megatron", latest) if not is_pruned(layout, n, "megatron")]
    if full:
        keep.add((max(full), "megatron"))
    return keep


def plan(
    layout: RunLayout,
    *,
    resumable: KeepRule,
    weights: KeepRule,
    eval_metric: Callable[[int, str], float | None],
    staleness: int = 0,
) -> list[Decision]:
    """A decision for every committed, not yet pruned checkpoint up to LATEST."""
    latest = read_latest(layout)
    if latest is None:
        return []
    guard = protected(layout, latest, staleness=staleness)
    decisions = []
    for kind in CHECKPOINT_KINDS:
        rule = resumable if kind in RESUMABLE_KINDS else weights
        present = [n for n in _committed(layout, kind, latest) if not is_pruned(layout, n, kind)]
        last = set(present[-rule.last :]) if rule.last else set()
        best = None
        if rule.best is not None:
            scored = [(value, n) for n in present if (value := eval_metric(n, rule.best)) is not None]
            best = max(scored)[1] if scored else None
        for n in present:
            if (n, kind) in guard:
                keep, reason = True, "needed to resume or for the next iteration"
            elif rule.keeps_all:
                keep, reason = True, "no retention rule"
            elif n in last:
                keep, reason = True, f"among the last {rule.last}"
            elif rule.every and n % rule.every == 0:
                keep, reason = True, f"every {rule.every}th"
            elif n == best:
                keep, reason = True, f"best {rule.best}"
            else:
                keep, reason = False, "outside the retention rule"
            size = int(read_manifest(layout, layout.checkpoint_manifest(n, kind)).data["bytes"])
            decisions.append(Decision(n, kind, size, keep, reason))
    return decisions


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


def finish_interrupted_prunes(layout: RunLayout) -> None:
    """Delete the files of checkpoints whose tombstone exists (a prune killed half-way)."""
    for n in layout.checkpoint_iterations():
        for kind in CHECKPOINT_KINDS:
            if is_pruned(layout, n, kind) and layout.store.list_files(layout.checkpoint_files_dir(n, kind)):
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
    """Plan and (unless `dry_run`) prune; returns the plan."""
    decisions = plan(layout, resumable=resumable, weights=weights, eval_metric=eval_metric, staleness=staleness)
    if not dry_run:
        finish_interrupted_prunes(layout)
        for decision in decisions:
            if not decision.keep:
                prune(layout, decision)
    return decisions
