"""The fast tier's run of the whole pipeline (`make test-fast`): `sdpo run` as `make demo` starts it,
with no Prefect server of its own (the ephemeral one), on the tiny config; then `sdpo verify`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.integration.runs import TINY, write_config

REPO = Path(__file__).resolve().parents[2]


def _sdpo(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )


def test_sdpo_run_trains_commits_and_verifies_on_the_ephemeral_server(tmp_path):
    from storage.checkpoints import lineage
    from storage.layout import RunLayout
    from storage.manifest import read_latest

    config = write_config(tmp_path, "smoke", base={**TINY, "iterations": 2})
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")

    run = _sdpo("run", str(config), env=env)
    said = run.stdout + run.stderr
    assert run.returncode == 0, said[-4000:]
    assert "iteration 1/2" in said and "iteration 2/2" in said, said[-4000:]

    layout = RunLayout(str(tmp_path / "runs"), "smoke")
    assert read_latest(layout) == 2
    policies = [r for r in lineage(layout) if r.kind == "policy"]
    assert [r.iteration for r in policies] == [0, 1, 2] and all(r.committed for r in policies)
    assert all(r.parent_ok and r.trained_on_ok for r in policies[1:])  # each trained on its own iteration's data

    verify = _sdpo("verify", "smoke", "--root", str(tmp_path / "runs"), env=env)
    assert verify.returncode == 0 and "OK: everything committed matches its manifests" in verify.stdout, (
        verify.stdout[-3000:] + verify.stderr[-3000:]
    )
