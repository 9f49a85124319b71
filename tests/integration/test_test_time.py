"""`sdpo test-time`: the baseline and discovery stages, one child run per question and seed, the
curves checked against what the runs committed, and a study killed at every test-time crash point
(and inside a child's iteration) ending with the same discovery record as an uninterrupted one."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from storage.faults import TEST_TIME_CRASH_POINTS
from tests.integration.runs import TINY, write_config
from tests.integration.test_crash_resume import crash_and_resume, leftovers, run_env, sdpo

NAME = "tt"
GROUP = 4
TEST_TIME = {
    "screen_prompts": 4,
    "num_questions": 2,
    "max_base_success": 1.0,
    "max_attempts": 8,
    "baseline_attempts": 8,
    "seeds": [0, 1],
}
CONFIG = {
    **TINY,
    "iterations": 1,
    "rollout": {**TINY["rollout"], "group_size": GROUP},
    "train": {"steps_per_iteration": 2, "micro_batch_size": 2},
    "eval": {"enabled": False, "every": 0},
    "test_time": TEST_TIME,
}
# every test-time stage boundary, and a child run killed after its first rollout committed
CHAIN = [f"{p}@0" for p in TEST_TIME_CRASH_POINTS[:3]] + ["stage.committed:rollout@1"]
CHAIN += [f"{p}@0" for p in TEST_TIME_CRASH_POINTS[3:]]


def study(tmp: Path) -> tuple[Path, Path]:
    config = write_config(tmp, NAME, base=CONFIG)
    return config, tmp / "runs"


def discovery_bytes(root: Path) -> bytes:
    from storage.layout import RunLayout
    from storage.stages import read_stage_file
    from tasks.test_time import DISCOVERY_FILE

    return read_stage_file(RunLayout(str(root), NAME), 0, "discovery", DISCOVERY_FILE)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, prefect_server: str) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("test-time")
    config, root = study(tmp)
    done = sdpo(["test-time", str(config)], run_env(prefect_server))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "discovery@k" in done.stdout and "best-of-k" in done.stdout
    return root, json.loads(discovery_bytes(root))


def test_the_curves_are_what_the_child_runs_and_the_baseline_committed(reference):
    from sdpo_core.evaluation import pass_at_k
    from storage.checkpoints import resolve_checkpoint
    from storage.layout import RunLayout
    from storage.manifest import read_latest
    from storage.shard_reader import read_stage_columns

    root, record = reference
    assert record["k"] == [4, 8]
    assert len(record["questions"]) == 2 and len(record["attacks"]) == 4
    parent = RunLayout(str(root), NAME)
    base_sha = resolve_checkpoint(parent, 0, "policy").data["files"]
    found = []
    for attack in record["attacks"]:
        child = RunLayout(str(root), attack["run"])
        # the child starts from the parent's base weights, bit for bit
        assert resolve_checkpoint(child, 0, "policy").data["files"] == base_sha
        rewards = []
        for n in range(1, (read_latest(child) or 0) + 1):
            cols = read_stage_columns(child, n, "rollout", columns=["reward", "prompt_id"])
            assert set(cols["prompt_id"]) == {attack["prompt_id"]}, "a child trains on its one question only"
            rewards += [float(r) for r in cols["reward"]]
        first = next((i + 1 for i, r in enumerate(rewards) if r >= 1.0), None)
        assert first == attack["first_success"]
        if first is None:  # the whole budget was spent
            assert len(rewards) == TEST_TIME["max_attempts"]
        else:  # stopped after the iteration that found it
            assert read_latest(child) == math.ceil(first / GROUP)
        found.append(first)
    expected_sdpo = [sum(1 for f in found if f is not None and f <= k) / len(found) for k in record["k"]]
    assert record["test_time"] == pytest.approx(expected_sdpo)
    n = TEST_TIME["baseline_attempts"]
    expected_best = [sum(pass_at_k(n, q["correct"], k) for q in record["questions"]) / 2 for k in record["k"]]
    assert record["best_of_k"] == pytest.approx(expected_best)


def test_a_finished_study_is_only_read_back(tmp_path, reference, prefect_server):
    from storage.layout import RunLayout
    from storage.manifest import read_stage_manifest

    root, record = reference
    before = read_stage_manifest(RunLayout(str(root), NAME), 0, "discovery").sha256
    again = sdpo(["test-time", str(root.parent / f"{NAME}.yaml")], run_env(prefect_server))
    assert again.returncode == 0, again.stderr[-3000:]
    assert read_stage_manifest(RunLayout(str(root), NAME), 0, "discovery").sha256 == before


def test_killed_at_every_test_time_point_ends_with_the_same_discovery(tmp_path, prefect_server, reference):
    root_ref, record = reference
    config, root = study(tmp_path)
    crash_and_resume(config, run_env(prefect_server), CHAIN, command="test-time")
    assert discovery_bytes(root) == discovery_bytes(root_ref)
    assert leftovers(root, tmp_path / "cache") == []


def test_a_config_whose_per_question_runs_are_invalid_is_refused_before_anything_is_written(tmp_path):
    # 8 steps divide the parent's 16 samples of an iteration, not one question's 4
    config = write_config(tmp_path, NAME, base={**CONFIG, "train": {"steps_per_iteration": 8, "micro_batch_size": 1}})
    refused = sdpo(["test-time", str(config)], dict(os.environ))
    assert refused.returncode == 2
    assert "test_time: each question runs with data.prompts_per_iteration=1" in refused.stderr
    assert "train.steps_per_iteration=8" in refused.stderr
    assert not (tmp_path / "runs").exists()
