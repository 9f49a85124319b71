"""The train / eval splits are read once per process and read again when their file changes."""

from __future__ import annotations

import json
import os

import tasks.data.prompts as prompts
from tasks.config import load_config


def _write(path, ids):
    rows = [
        {
            "prompt_id": i,
            "prompt_messages": [{"role": "user", "content": f"question {i}"}],
            "label": i,
            "data_source": "t",
        }
        for i in ids
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _count_reads(monkeypatch):
    calls = []
    original = prompts._read_splits

    def counted(data, *, seed):
        calls.append(seed)
        return original(data, seed=seed)

    monkeypatch.setattr(prompts, "_read_splits", counted)
    monkeypatch.setattr(prompts, "_SPLITS", {})
    return calls


def test_the_same_file_is_read_once_and_every_caller_gets_its_own_lists(tmp_path, monkeypatch):
    calls = _count_reads(monkeypatch)
    data = tmp_path / "data.jsonl"
    _write(data, [f"q{i}" for i in range(20)])
    cfg = load_config(None, ["data.source=prepared", f"data.path={data}", "data.eval_fraction=0.25"])
    first_train, first_eval = prompts.load_splits(cfg.data, seed=3)
    first_train.clear()  # a caller's list is its own
    again_train, again_eval = prompts.load_splits(cfg.data, seed=3)
    assert calls == [3]
    assert len(again_train) == 15 and [r["prompt_id"] for r in again_eval] == [r["prompt_id"] for r in first_eval]
    prompts.load_splits(cfg.data, seed=4)  # another seed, another split
    assert calls == [3, 4]


def test_a_file_replaced_in_place_is_read_again(tmp_path, monkeypatch):
    calls = _count_reads(monkeypatch)
    data = tmp_path / "data.jsonl"
    _write(data, ["a1", "a2", "a3", "a4"])
    cfg = load_config(None, ["data.source=prepared", f"data.path={data}", "data.eval_fraction=0.25"])
    before = {r["prompt_id"] for r in prompts.training_rows(cfg.data, seed=0)}
    stamp = data.stat().st_mtime_ns
    _write(data, ["b1", "b2", "b3", "b4"])  # same size, new rows
    os.utime(data, ns=(stamp + 10**9, stamp + 10**9))
    after = {r["prompt_id"] for r in prompts.training_rows(cfg.data, seed=0)}
    assert len(calls) == 2
    assert before <= {"a1", "a2", "a3", "a4"} and after <= {"b1", "b2", "b3", "b4"} and len(after) == 3


def test_the_memo_keeps_a_few_configurations_only(monkeypatch):
    calls = _count_reads(monkeypatch)
    for operand in range(5, 5 + prompts._SPLITS_KEPT + 2):
        cfg = load_config(None, [f"data.max_operand={operand}"])
        prompts.load_splits(cfg.data, seed=0)
    assert len(prompts._SPLITS) == prompts._SPLITS_KEPT
    assert len(calls) == prompts._SPLITS_KEPT + 2
