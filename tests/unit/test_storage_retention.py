"""Retention: the rules keep exactly their union plus what a resume needs; pruning is tombstone first."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

from storage.cache import download_checkpoint, evict_least_recently_used
from storage.checkpoints import lineage, upload_checkpoint
from storage.layout import RunLayout, create_or_open_run
from storage.manifest import commit_iteration
from storage.retention import KeepRule, PrunedCheckpointError, apply, apply_after_commit, is_pruned
from storage.stages import StageOutput


def _run(tmp_path: Path, iterations: int, *, megatron_every: int = 1) -> RunLayout:
    layout = RunLayout(f"memory://retention-{uuid.uuid4().hex}", "r")
    create_or_open_run(layout, {"lr": 1.0})
    weights = tmp_path / "w"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"w" * 10)
    upload_checkpoint(weights, layout, 0, "policy", parent="base")
    for n in range(1, iterations + 1):
        _grow(layout, weights, n, megatron_every=megatron_every)
    return layout


def _kept(layout: RunLayout, kind: str, iterations: int) -> list[int]:
    return [
        n
        for n in range(iterations + 1)
        if layout.store.exists(layout.checkpoint_manifest(n, kind)) and not is_pruned(layout, n, kind)
    ]


def test_rules_keep_their_union_and_what_resume_needs(tmp_path: Path) -> None:
    layout = _run(tmp_path, 10)
    accuracy = {2: 0.1, 4: 0.7, 6: 0.3, 8: 0.2, 10: 0.5}
    apply(
        layout,
        resumable=KeepRule(last=2),
        weights=KeepRule(last=2, every=5, best="eval/acc"),
        eval_metric=lambda n, name: accuracy.get(n) if name == "eval/acc" else None,
    )
    assert _kept(layout, "megatron", 10) == [9, 10]
    assert _kept(layout, "policy", 10) == [0, 4, 5, 9, 10]  # base, best (4), every 5th, last 2
    assert _kept(layout, "teacher", 10) == [4, 5, 9, 10]
    records = {(r.iteration, r.kind): r for r in lineage(layout)}
    assert records[(3, "policy")].pruned and records[(3, "policy")].committed  # the chain of digests stays
    with pytest.raises(PrunedCheckpointError, match="checkpoint policy of iteration 3 was pruned"):
        download_checkpoint(layout, 3, "policy", cache_dir=tmp_path / "cache")
    assert download_checkpoint(layout, 10, "policy", cache_dir=tmp_path / "cache").is_dir()


def test_no_rule_keeps_everything_and_a_dry_run_deletes_nothing(tmp_path: Path) -> None:
    layout = _run(tmp_path, 4)
    keep_all = dict(resumable=KeepRule(), weights=KeepRule(), eval_metric=lambda n, m: None, dry_run=True)
    assert all(d.keep for d in apply(layout, **keep_all))
    decisions = apply(
        layout, resumable=KeepRule(last=1), weights=KeepRule(last=1), eval_metric=lambda n, m: None, dry_run=True
    )
    assert {d.bytes for d in decisions} == {10}  # each checkpoint's one 10-byte file, from the listing
    assert sorted((d.iteration, d.kind) for d in decisions if not d.keep) == [
        (1, "megatron"),
        (1, "policy"),
        (1, "teacher"),
        (2, "megatron"),
        (2, "policy"),
        (2, "teacher"),
        (3, "megatron"),
        (3, "policy"),
        (3, "teacher"),
    ]
    assert _kept(layout, "policy", 4) == [0, 1, 2, 3, 4]


def test_the_last_full_training_state_is_kept_even_when_the_rule_would_drop_it(tmp_path: Path) -> None:
    layout = _run(tmp_path, 7, megatron_every=3)  # full states at 3 and 6; LATEST = 7
    apply(layout, resumable=KeepRule(every=100), weights=KeepRule(last=1), eval_metric=lambda n, m: None)
    assert _kept(layout, "megatron", 7) == [6]
    assert _kept(layout, "policy", 7) == [0, 7]


def test_a_prune_killed_after_its_tombstone_is_finished(tmp_path: Path) -> None:
    layout = _run(tmp_path, 3)
    layout.store.write_bytes(
        layout.checkpoint_tombstone(1, "policy"), b'{"pruned_at": "t", "reason": "r", "bytes": 10}'
    )
    assert layout.store.list_files(layout.checkpoint_files_dir(1, "policy"))
    apply(layout, resumable=KeepRule(), weights=KeepRule(), eval_metric=lambda n, m: None)
    assert layout.store.list_files(layout.checkpoint_files_dir(1, "policy")) == []


def test_the_cache_evicts_least_recently_used_checkpoints(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    folders = []
    for i in range(4):
        folder = cache / (f"{i}" * 64)
        folder.mkdir(parents=True)
        (folder / "w").write_bytes(b"x" * 100)
        os.utime(folder, (time.time() - 100 + i, time.time() - 100 + i))
        folders.append(folder)
    os.utime(folders[0])  # used just now
    removed = evict_least_recently_used(cache, max_bytes=250, keep=folders[3])
    assert removed == [folders[1], folders[2]]
    assert folders[0].exists() and folders[3].exists()


def test_with_staleness_k_the_last_k_policies_and_teachers_are_kept_for_the_iterations_ahead(tmp_path: Path) -> None:
    layout = _run(tmp_path, 6)
    apply(layout, resumable=KeepRule(last=1), weights=KeepRule(last=1), eval_metric=lambda n, m: None, staleness=2)
    assert _kept(layout, "policy", 6) == [0, 4, 5, 6]  # iterations 7, 8, 9 sample from 4, 5, 6
    assert _kept(layout, "teacher", 6) == [4, 5, 6]
    assert _kept(layout, "megatron", 6) == [6]


def _grow(layout: RunLayout, weights: Path, n: int, *, megatron_every: int = 1) -> None:
    """Iteration n of `_run`'s run: its three stages, its checkpoints, its commit."""
    for stage in ("rollout", "teacher", "train"):
        output = StageOutput(layout, n, stage)
        output.write_json("x.json", {"n": n})
        output.commit()
    kinds = ["policy", "teacher"] + (["megatron"] if n % megatron_every == 0 else [])
    for kind in kinds:
        upload_checkpoint(weights, layout, n, kind, parent="base")
    commit_iteration(layout, n, metrics={}, checkpoints=kinds)


RULE_SETS = {
    "keep everything": (KeepRule(), KeepRule(), 0, 1),
    "last, every, best": (KeepRule(last=2), KeepRule(last=2, every=5, best="eval/acc"), 0, 1),
    "best alone": (KeepRule(every=100), KeepRule(best="eval/acc"), 0, 3),
    "staleness 2": (KeepRule(last=1), KeepRule(last=1, every=4), 2, 2),
}


@pytest.mark.parametrize("rules", sorted(RULE_SETS))
def test_the_pass_after_each_commit_keeps_what_a_full_pass_keeps(tmp_path: Path, rules: str) -> None:
    """Two copies of one run grow side by side; after every commit one gets the incremental pass, the
    other a full pass. The checkpoints each keeps agree at every iteration, and on the incremental
    copy a full dry run then finds nothing more to prune."""
    resumable, weights_rule, staleness, megatron_every = RULE_SETS[rules]
    accuracy = {2: 0.1, 4: 0.7, 6: 0.3, 9: 0.9, 12: 0.2, 15: 0.95, 18: 0.4}  # a new best at 4, 9, 15
    metric = lambda n, name: accuracy.get(n) if name == "eval/acc" else None  # noqa: E731
    weights = tmp_path / "w"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"w" * 10)
    runs = []
    for _ in range(2):
        layout = RunLayout(f"memory://retention-{uuid.uuid4().hex}", "r")
        create_or_open_run(layout, {"lr": 1.0})
        upload_checkpoint(weights, layout, 0, "policy", parent="base")
        runs.append(layout)
    incremental, full = runs
    common = dict(resumable=resumable, weights=weights_rule, eval_metric=metric, staleness=staleness)
    for n in range(1, 21):
        for layout in runs:
            _grow(layout, weights, n, megatron_every=megatron_every)
        apply_after_commit(incremental, **common)
        apply(full, **common)
        for kind in ("policy", "teacher", "megatron"):
            assert _kept(incremental, kind, n) == _kept(full, kind, n), (n, kind)
        assert all(d.keep for d in apply(incremental, dry_run=True, **common)), n


class _Counted:
    """The store operations made while installed, by name."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from storage.objects import ObjectStore

        self.ops: list[str] = []
        original = ObjectStore._call

        def call(store: ObjectStore, fn: object, what: str, url: str) -> object:
            self.ops.append(what)
            return original(store, fn, what, url)

        monkeypatch.setattr(ObjectStore, "_call", call)


@pytest.mark.parametrize("rules", ["keep everything", "last, every, best"])
def test_the_pass_after_a_commit_costs_the_same_store_operations_at_iteration_40_as_at_10(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rules: str
) -> None:
    resumable, weights_rule, staleness, _ = RULE_SETS[rules]
    common = dict(resumable=resumable, weights=weights_rule, eval_metric=lambda n, m: None, staleness=staleness)
    layout = _run(tmp_path, 0)
    weights = tmp_path / "w"
    operations = {}
    for n in range(1, 41):
        _grow(layout, weights, n)
        if n in (10, 40):
            counted = _Counted(monkeypatch)
            apply_after_commit(layout, **common)
            operations[n] = counted.ops
            monkeypatch.undo()
        else:
            apply_after_commit(layout, **common)
    assert operations[40] == operations[10], operations
    # LATEST, the record, the new iteration's three manifests, the previous iteration's full state
    # (a tombstone and a manifest: saved in the background, it lands after that iteration's pass),
    # the record again; a prune's size, tombstone check, tombstone and files: 4 operations, for the
    # iteration two back's 3 checkpoints
    prunes = 3 if rules == "last, every, best" else 0
    assert len(operations[40]) <= 9 + 4 * prunes, operations[40]


def test_a_pass_killed_between_its_prunes_and_its_record_is_made_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from storage.objects import ObjectStore

    common = dict(resumable=KeepRule(last=1), weights=KeepRule(last=1), eval_metric=lambda n, m: None)
    layout = _run(tmp_path, 3)
    apply_after_commit(layout, **common)
    _grow(layout, tmp_path / "w", 4)
    original = ObjectStore.remove_tree

    def killed(store: ObjectStore, url: str) -> None:
        raise KeyboardInterrupt("killed after the tombstone")

    monkeypatch.setattr(ObjectStore, "remove_tree", killed)
    with pytest.raises(KeyboardInterrupt):
        apply_after_commit(layout, **common)
    monkeypatch.setattr(ObjectStore, "remove_tree", original)
    assert is_pruned(layout, 3, "megatron") or is_pruned(layout, 3, "policy") or is_pruned(layout, 3, "teacher")
    apply_after_commit(layout, **common)
    for kind in ("policy", "teacher", "megatron"):
        for n in (1, 2, 3):
            assert layout.store.list_files(layout.checkpoint_files_dir(n, kind)) == [], (n, kind)
    assert _kept(layout, "policy", 4) == [0, 4]


def test_a_rule_changed_mid_run_gets_a_full_pass(tmp_path: Path) -> None:
    layout = _run(tmp_path, 6)
    apply_after_commit(layout, resumable=KeepRule(), weights=KeepRule(), eval_metric=lambda n, m: None)
    assert _kept(layout, "teacher", 6) == [1, 2, 3, 4, 5, 6]
    _grow(layout, tmp_path / "w", 7)
    apply_after_commit(layout, resumable=KeepRule(last=1), weights=KeepRule(every=3), eval_metric=lambda n, m: None)
    assert _kept(layout, "teacher", 7) == [3, 6, 7]
    assert _kept(layout, "megatron", 7) == [7]
