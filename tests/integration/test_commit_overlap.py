"""Pipelined commits (flows/overlap.py, tasks/handover.py): iteration n+1 samples and scores from
iteration n's weights in memory while iteration n's checkpoints are still being written, and the
run commits exactly what a sequential run commits."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest
import torch

from tests.integration.runs import TINY, differences, fingerprint, forget_process_state, write_config

CONFIG = {**TINY, "iterations": 3, "eval": {"every": 2, "sampled_n": 2}}
WAIT_S = 300.0


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of the weights file the train stage writes from these tensors."""
    from safetensors.torch import save

    return hashlib.sha256(save({k: v.contiguous() for k, v in tensors.items()}, metadata={"format": "pt"})).hexdigest()


def test_the_next_rollout_samples_from_handed_over_weights_before_the_store_holds_them(
    tmp_path: Path, prefect_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import storage.manifest
    import tasks.rollout
    import tasks.train
    from flows.run import sdpo_run
    from storage.checkpoints import resolve_checkpoint
    from storage.layout import RunLayout
    from storage.stages import StageOutput
    from tasks.kept_weights import weights_digest

    events: list[tuple[str, int]] = []
    lock = threading.Lock()
    sampled: dict[int, dict[str, torch.Tensor]] = {}
    rollout_started = threading.Event()

    sample_groups = tasks.rollout.sample_groups

    def recording_sample_groups(run, **kwargs):
        if kwargs.get("weights") is not None:  # a rollout stage sampling from weights handed over
            sampled[kwargs["iteration"]] = {k: v.detach().clone() for k, v in kwargs["weights"].items()}
            rollout_started.set()
        return sample_groups(run, **kwargs)

    store_checkpoint = tasks.train._store_checkpoint

    def held_store_checkpoint(run, weights, folder, iteration, kind, **kwargs):
        # the policy of iteration 1 is not written until the next rollout has its weights: the
        # rollout of iteration 2 must not need the store
        if iteration == 1 and kind == "policy":
            assert rollout_started.wait(WAIT_S), "the next rollout waited for the store"
        return store_checkpoint(run, weights, folder, iteration, kind, **kwargs)

    stage_commit = StageOutput.commit

    def recording_stage_commit(self, **kwargs):
        with lock:
            events.append((f"stage:{self.stage}", self.iteration))
        return stage_commit(self, **kwargs)

    commit_iteration = storage.manifest.commit_iteration

    def recording_commit_iteration(layout, n, **kwargs):
        manifest = commit_iteration(layout, n, **kwargs)
        with lock:
            events.append(("committed", n))
        return manifest

    monkeypatch.setattr(tasks.rollout, "sample_groups", recording_sample_groups)
    monkeypatch.setattr(tasks.train, "_store_checkpoint", held_store_checkpoint)
    monkeypatch.setattr(StageOutput, "commit", recording_stage_commit)
    monkeypatch.setattr(storage.manifest, "commit_iteration", recording_commit_iteration)
    forget_process_state()
    sdpo_run(str(write_config(tmp_path, "overlap", base=CONFIG)), [])

    layout = RunLayout(str(tmp_path / "runs"), "overlap")
    # iterations 2 and 3 sampled from the policy of the iteration before, handed over in memory
    assert sorted(sampled) == [2, 3]
    for n, weights in sampled.items():
        stored = resolve_checkpoint(layout, f"iter-{n - 1}", "policy")
        assert _digest(weights) == weights_digest(stored), (
            f"iteration {n} sampled other weights than iteration {n - 1} stored"
        )
    # no stage of iteration n+1 committed before iteration n was
    for n in (1, 2):
        committed_at = events.index(("committed", n))
        later = [e for e in events if e[1] == n + 1 and e[0].startswith("stage:")]
        assert later and all(events.index(e) > committed_at for e in later), events


def test_overlapped_and_sequential_runs_commit_the_same_bytes(tmp_path: Path, prefect_server: str) -> None:
    from flows.run import sdpo_run
    from storage.layout import RunLayout

    forget_process_state()
    sdpo_run(str(write_config(tmp_path / "a", "same", base=CONFIG)), [])
    forget_process_state()
    sequential = write_config(tmp_path / "b", "same", base=CONFIG, launch={"overlap_commits": False})
    sdpo_run(str(sequential), [])
    a = fingerprint(RunLayout(str(tmp_path / "a" / "runs"), "same"))
    b = fingerprint(RunLayout(str(tmp_path / "b" / "runs"), "same"))
    assert differences(a, b) == []


def test_a_train_stage_that_fails_after_handing_over_fails_the_run_without_committing(
    tmp_path: Path, prefect_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next rollout has started from the weights; the failure still stops the run, and nothing of
    the next iteration is committed."""
    import tasks.train
    from flows.run import sdpo_run
    from storage.layout import RunLayout
    from storage.manifest import read_latest, stage_done

    store_checkpoint = tasks.train._store_checkpoint

    def failing_store_checkpoint(run, weights, folder, iteration, kind, **kwargs):
        if iteration == 1 and kind == "policy":
            raise OSError("the disk is full")
        return store_checkpoint(run, weights, folder, iteration, kind, **kwargs)

    monkeypatch.setattr(tasks.train, "_store_checkpoint", failing_store_checkpoint)
    forget_process_state()
    with pytest.raises(Exception, match="the disk is full"):
        sdpo_run(str(write_config(tmp_path, "fails", base=CONFIG)), [])
    layout = RunLayout(str(tmp_path / "runs"), "fails")
    assert read_latest(layout) is None  # not even iteration 1 committed
    assert not stage_done(layout, 2, "rollout") and not stage_done(layout, 2, "teacher")
