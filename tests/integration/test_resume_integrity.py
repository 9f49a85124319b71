"""A resumed run checks what it adopts, and two runs of one config commit the same bytes.

A run interrupted after some stages of an iteration committed is resumed with `sdpo run`: a shard
damaged after the stage that read it committed, a stage manifest edited (valid JSON) before
anything named it, or LATEST edited, is refused with the file named and what to do, and doing what
the message says finishes the run, which then verifies. Two uninterrupted runs of one config hold
the same files with the same bytes but for the wall-clock fields of their JSON records
(storage/compare.py), which `sdpo verify --compare` leaves out and nothing else.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.integration.runs import forget_process_state, write_config

REPO = Path(__file__).resolve().parents[2]
NAME = "resumed"
runner = CliRunner()


def _interrupted(tmp_path: Path, stages: tuple[str, ...]) -> tuple[Path, Path]:
    """A one-iteration run whose iteration 1 has committed `stages` and nothing after them, as a
    killed run leaves it; returns (its config, its run folder)."""
    from tasks.config import load_config
    from tasks.launch import run_stage
    from tasks.runtime import run_layout, start_run

    forget_process_state()
    config = write_config(tmp_path, NAME, iterations=1)
    cfg = load_config(config)
    start_run(cfg, run_layout(cfg))
    for stage in ("prepare-base", *stages):
        run_stage(stage, cfg.storage.root, NAME, 0 if stage == "prepare-base" else 1)
    return config, tmp_path / "runs" / NAME


def _resume(config: Path) -> None:
    from flows.run import sdpo_run

    forget_process_state()
    sdpo_run(str(config), [])


def _verify(run: Path) -> tuple[int, str]:
    from flows.cli import app

    result = runner.invoke(app, ["verify", run.name, "--root", str(run.parent)])
    return result.exit_code, result.output


def _flip(path: Path) -> None:
    """Change one letter or digit past the middle of the file (its size stays)."""
    data = bytearray(path.read_bytes())
    i = next(i for i in range(len(data) // 2, len(data)) if chr(data[i]).isalnum())
    data[i] = ord("0") if chr(data[i]) != "0" else ord("1")
    path.write_bytes(bytes(data))


def test_a_shard_damaged_after_its_consumer_read_it_is_refused_on_resume(tmp_path, prefect_server):
    """The rollout shard changes after the teacher stage read it and committed: the resume refuses to
    commit the iteration on it, naming the shard; deleting the stages the message names redoes them."""
    from storage.errors import DamagedOutputError

    config, run = _interrupted(tmp_path, ("rollout", "teacher"))
    shard = run / "iter-1" / "rollout" / "part-00000.parquet"
    _flip(shard)
    with pytest.raises(DamagedOutputError) as refused:
        _resume(config)
    message = str(refused.value)
    assert refused.value.url == f"file://{shard}"
    assert f"file://{shard}" in message and "sdpo verify" in message
    assert f"delete file://{run}/iter-1/rollout, file://{run}/iter-1/teacher and run" in message
    assert not (run / "iter-1" / "_manifest.json").exists()
    for stage in ("rollout", "teacher"):
        shutil.rmtree(run / "iter-1" / stage)
    _resume(config)
    assert json.loads((run / "LATEST").read_text())["iteration"] == 1
    assert _verify(run)[0] == 0


@pytest.mark.parametrize("stage", ["rollout", "teacher", "train"])
def test_a_stage_manifest_edited_before_its_iteration_commits_is_refused(tmp_path, prefect_server, stage):
    """A valid-JSON edit of the last committed stage's manifest, which no other manifest names yet
    (a metric changed, the file re-indented alike): the resume refuses it, naming the manifest."""
    from storage.errors import DamagedOutputError

    stages = ("rollout", "teacher", "train")
    config, run = _interrupted(tmp_path, stages[: stages.index(stage) + 1])
    manifest = run / "iter-1" / stage / "_manifest.json"
    data = json.loads(manifest.read_text())
    key = sorted(data["metrics"])[0]
    data["metrics"][key] += 1.0
    manifest.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    with pytest.raises(DamagedOutputError, match="was changed after it was written") as refused:
        _resume(config)
    assert refused.value.url == f"file://{manifest}" and f"file://{manifest}" in str(refused.value)
    assert not (run / "iter-1" / "_manifest.json").exists()


def test_a_damaged_latest_is_refused_by_sdpo_run_and_rebuilt_once_deleted(tmp_path, prefect_server):
    from storage.errors import DamagedOutputError

    config, run = _interrupted(tmp_path, ())
    _resume(config)
    latest = run / "LATEST"
    pointer = json.loads(latest.read_text())
    latest.write_text(json.dumps({**pointer, "sha256": "0" * 64}))
    with pytest.raises(DamagedOutputError, match="LATEST does not check out") as refused:
        _resume(config)
    assert refused.value.url == f"file://{latest}"
    assert "delete file://" + str(latest) in str(refused.value)
    latest.unlink()
    _resume(config)
    assert json.loads(latest.read_text())["sha256"] == pointer["sha256"]
    assert _verify(run)[0] == 0


def _sdpo(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )


def _digests(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_two_uninterrupted_runs_commit_the_same_bytes(tmp_path, prefect_server):
    """Two `sdpo run` processes of one config (named apart, each with an empty checkpoint cache): the
    same files; every file but the JSON records with the same sha256; the records the same but for
    their wall-clock fields, and `sdpo verify --compare` says so, while it still sees a flipped byte
    or a changed metric."""
    from storage.compare import compare_runs, is_record
    from storage.layout import RunLayout

    env = {**os.environ, "PREFECT_API_URL": prefect_server, "PYTHONUNBUFFERED": "1"}
    for name in ("twin-a", "twin-b"):
        shutil.rmtree(tmp_path / "cache", ignore_errors=True)
        done = _sdpo(["run", str(write_config(tmp_path, name))], env)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    a, b = _digests(tmp_path / "runs" / "twin-a"), _digests(tmp_path / "runs" / "twin-b")
    assert sorted(a) == sorted(b)
    data = [p for p in a if not is_record(p)]
    assert any(p.endswith("/.metadata") for p in data) and any(p.endswith(".parquet") for p in data)
    assert {p: (a[p], b[p]) for p in data if a[p] != b[p]} == {}
    root = str(tmp_path / "runs")
    assert compare_runs(RunLayout(root, "twin-a"), RunLayout(root, "twin-b")).differences == []
    compared = _sdpo(["verify", "twin-a", "--root", root, "--compare", "twin-b"], env)
    assert compared.returncode == 0 and "OK: the same files as twin-b" in compared.stdout, compared.stderr

    # what the comparison leaves out is only that: a data byte or a metric is a difference
    _flip(tmp_path / "runs" / "twin-b" / "iter-1" / "teacher" / "part-00000.parquet")
    manifest = tmp_path / "runs" / "twin-b" / "iter-2" / "_manifest.json"
    record = json.loads(manifest.read_text())
    record["metrics"]["rollout/reward_mean"] += 0.5
    record["metrics"]["rollout/seconds"] += 0.5
    manifest.write_text(json.dumps(record))
    differences = compare_runs(RunLayout(root, "twin-a"), RunLayout(root, "twin-b")).differences
    assert [d.split(":")[0] for d in differences] == ["iter-1/teacher/part-00000.parquet", "iter-2/_manifest.json"]
    assert "metrics.rollout/reward_mean" in differences[1]
    assert _sdpo(["verify", "twin-a", "--root", root, "--compare", "twin-b"], env).returncode == 1
