"""Kill a real `sdpo run` at every crash point, run the same command again, compare with a run that
was never interrupted.

Each chain below is one run killed (SIGKILL of its whole process group, from
`storage.faults.crash_point`) at each of its points in turn, every kill followed by the same
command again, until a last run finishes it. The chain passes when every armed point was reached
(the process died by SIGKILL), the final run exited 0, and the run is indistinguishable from the
uninterrupted reference: LATEST, every committed file's sha256, the final policy, the file set,
the lineage, and MLflow holding each step and each sample table exactly once; and no temporary file is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from storage.faults import CRASH_POINTS, TEST_TIME_CRASH_POINTS
from tests.integration.runs import TINY, differences, fingerprint, sdpo_here, write_config

REPO = Path(__file__).resolve().parents[2]
ITERATIONS = 3
CONFIG = {**TINY, "iterations": ITERATIONS, "eval": {"every": 2, "sampled_n": 2}}
NAME = "crash"
EVAL_STEPS = [0, 2, 3]

CHAINS: dict[str, list[str]] = {
    "rollout-teacher": [
        f"{p}@2" for p in CRASH_POINTS if p.startswith("stage.") and p.endswith((":rollout", ":teacher"))
    ],
    "train": [f"{p}@2" for p in CRASH_POINTS if p.endswith(":train") or p.startswith(("train.", "checkpoint."))],
    "commit-eval-tracking": [
        f"{p}@2" for p in CRASH_POINTS if p.startswith(("commit.", "tracking.")) or p.endswith(":eval")
    ],
    # the next iteration's stages, sampled and scored from weights handed over in memory, killed
    # while the commit of the iteration before is still in flight (flows/overlap.py)
    "overlap": ["rollout.awaiting_parent_commit@2", "teacher.awaiting_parent_commit@3"],
    "base-and-last": [
        "checkpoint.uploading:policy@0",
        "checkpoint.committed:policy@0",
        "stage.committed:eval@0",
        "tracking.logged@0",
        "checkpoint.saving:megatron@3",  # the last iteration saves its full state in its own stage
        "checkpoint.uploading:megatron@3",
        "commit.manifest_written@3",  # the last iteration: LATEST must still reach it
        "stage.files_written:eval@3",
        "tracking.logged@3",
    ],
}


def test_the_chains_arm_every_crash_point() -> None:
    """Every point of a run's iterations (the test-time run's own are armed in test_test_time.py)."""
    armed = {point.split("@")[0] for chain in CHAINS.values() for point in chain}
    assert armed == set(CRASH_POINTS) - set(TEST_TIME_CRASH_POINTS)


def sdpo(args: Sequence[str], env: dict[str, str], *, crash_at: str | None = None) -> subprocess.CompletedProcess:
    """`sdpo ARGS` in its own process group, optionally armed to crash at one point."""
    child_env = dict(env)
    child_env.pop("SDPO_CRASH_AT", None)
    if crash_at is not None:
        child_env["SDPO_CRASH_AT"] = crash_at
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=REPO,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=600,
        start_new_session=True,
    )


def run_env(prefect_server: str, **extra: str) -> dict[str, str]:
    return {**os.environ, "PREFECT_API_URL": prefect_server, "PYTHONUNBUFFERED": "1", **extra}


def crash_and_resume(config: Path, env: dict[str, str], chain: Sequence[str], command: str = "run") -> None:
    """Kill `sdpo COMMAND config` at each point of `chain` in turn, then let it finish."""
    for point in chain:
        killed = sdpo([command, str(config)], env, crash_at=point)
        assert killed.returncode == -signal.SIGKILL, (
            f"crash point {point} was not reached (exit {killed.returncode}):\n{killed.stdout[-2000:]}{killed.stderr[-3000:]}"
        )
    done = sdpo([command, str(config)], env)
    assert done.returncode == 0, f"resume after {chain[-1]} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}"


def mlflow_steps(db: Path) -> dict[str, list[int]]:
    """The logged steps of a few metrics of the one MLflow run in `db`."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    runs = client.search_runs([client.get_experiment_by_name("sdpo").experiment_id])
    assert len(runs) == 1, f"{len(runs)} MLflow runs for one SDPO run"
    keys = ("tracking/step", "rollout/reward_mean", "train/loss_sdpo", "eval/greedy_accuracy")
    steps = {k: [m.step for m in client.get_metric_history(runs[0].info.run_id, k)] for k in keys}
    # every iteration's sample table once: listed by the run's tag, present among its artifacts
    listed = json.loads(runs[0].data.tags.get("mlflow.loggedArtifacts", "[]"))
    stored = sorted(a.path for a in client.list_artifacts(runs[0].info.run_id, "samples"))
    steps["sample tables"] = (
        [int(t["path"][-9:-5]) for t in listed] if stored == [t["path"] for t in listed] else stored
    )
    return steps


EXPECTED_STEPS = {
    "tracking/step": [0, 1, 2, 3],
    "rollout/reward_mean": [1, 2, 3],
    "train/loss_sdpo": [1, 2, 3],
    "eval/greedy_accuracy": EVAL_STEPS,
    "sample tables": [1, 2, 3],
}


def leftovers(*folders: Path) -> list[str]:
    """Temporary entries (owner-tagged names) still present under `folders`."""
    from storage.scratch import _OWNER

    return [str(p) for folder in folders if folder.exists() for p in folder.rglob("*") if _OWNER.search(p.name)]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory, prefect_server: str) -> tuple[dict, Path]:
    """The uninterrupted run: one `sdpo run` process; its fingerprint and its root."""
    from storage.layout import RunLayout

    tmp = tmp_path_factory.mktemp("reference")
    config = write_config(tmp, NAME, base=CONFIG)
    done = sdpo(["run", str(config)], run_env(prefect_server))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert mlflow_steps(tmp / "mlflow.db") == EXPECTED_STEPS
    return fingerprint(RunLayout(str(tmp / "runs"), NAME)), tmp / "runs"


@pytest.fixture(scope="module")
def reference(reference_run: tuple[dict, Path]) -> dict:
    return reference_run[0]


def assert_compares_identical(root: Path, reference_root: Path) -> None:
    """`sdpo verify --compare` both ways between the run under `root` and the uninterrupted one: exit 0,
    "identical" (the same files but for their wall-clock fields); how each run went is only a note."""
    for here, there in ((root, reference_root), (reference_root, root)):
        args = ["verify", NAME, "--root", str(here), "--compare", NAME, "--compare-root", str(there)]
        compared = sdpo_here(args)
        assert compared.returncode == 0, compared.stdout[-3000:] + compared.stderr[-3000:]
        assert f"OK: the same files as {NAME}" in compared.stdout


@pytest.mark.parametrize("chain", list(CHAINS), ids=list(CHAINS))
def test_killed_at_every_point_resumes_bit_identical(tmp_path, prefect_server, reference_run, chain):
    from storage.layout import RunLayout

    reference, reference_root = reference_run
    config = write_config(tmp_path, NAME, base=CONFIG)
    crash_and_resume(config, run_env(prefect_server), CHAINS[chain])
    resumed = fingerprint(RunLayout(str(tmp_path / "runs"), NAME))
    assert differences(reference, resumed) == []
    assert resumed["final_policy"] == reference["final_policy"]
    assert mlflow_steps(tmp_path / "mlflow.db") == EXPECTED_STEPS
    assert leftovers(tmp_path / "runs", tmp_path / "cache") == []
    assert_compares_identical(tmp_path / "runs", reference_root)


def test_one_process_per_iteration_ends_bit_identical(tmp_path, prefect_server, reference_run):
    """`sdpo advance` (the scheduled deployment's flow), a new process for each iteration, killed once."""
    from storage.layout import RunLayout

    config = write_config(tmp_path, NAME, base=CONFIG)
    env = run_env(prefect_server)
    first = sdpo(["advance", str(config)], env)
    assert first.returncode == 0 and "committed iter-1/_manifest.json" in first.stdout, first.stderr[-4000:]
    crash_and_resume(config, env, ["checkpoint.committed:policy@2"], command="advance")  # ends iteration 2
    for expected in ("committed iter-3/_manifest.json", "is complete"):
        done = sdpo(["advance", str(config)], env)
        assert done.returncode == 0 and expected in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]
    advanced = fingerprint(RunLayout(str(tmp_path / "runs"), NAME))
    assert differences(reference_run[0], advanced) == []
    assert mlflow_steps(tmp_path / "mlflow.db") == EXPECTED_STEPS
    assert_compares_identical(tmp_path / "runs", reference_run[1])  # summary.base was empty


def test_killed_runs_on_s3_resume_bit_identical(tmp_path, prefect_server, reference, s3_server):
    from storage.layout import RunLayout

    options = s3_server.storage_options()
    root = f"s3://{s3_server.make_bucket()}/runs"
    config = write_config(
        tmp_path, NAME, root=root, base=CONFIG, storage={"storage_options": {"endpoint_url": s3_server.endpoint_url}}
    )
    env = run_env(
        prefect_server,
        AWS_ACCESS_KEY_ID=options["key"],
        AWS_SECRET_ACCESS_KEY=options["secret"],
        AWS_DEFAULT_REGION=options["client_kwargs"]["region_name"],
    )
    # one point in each stage's write path: shards, a multi-file checkpoint, a committed checkpoint, the commit
    chain = [
        "stage.files_written:teacher@2",
        "checkpoint.committed:policy@2",
        "commit.manifest_written@2",
        "checkpoint.uploading:megatron@2",  # saved in the background: uploaded by iteration 3's train stage
    ]
    crash_and_resume(config, env, chain)
    resumed = fingerprint(RunLayout(root, NAME, storage_options=options))
    assert differences(reference, resumed) == []
    assert mlflow_steps(tmp_path / "mlflow.db") == EXPECTED_STEPS
    assert leftovers(tmp_path / "cache") == []


def test_a_full_disk_fails_naming_the_file_then_resumes_bit_identical(tmp_path, prefect_server, reference):
    """The run store on a real 1.6 MB tmpfs (the run needs 2.7 MB): the run fails with ENOSPC naming
    the URL and leaves no temporary file; once the filesystem grows, the same command finishes it."""
    from storage.layout import RunLayout

    disk = tmp_path / "disk"
    disk.mkdir()
    config = write_config(tmp_path, NAME, root=str(disk / "runs"), base=CONFIG)
    sdpo_cli = f"{sys.executable} -m flows.cli run {config}"
    script = (
        f"set -u; mount -t tmpfs -o size=1600k tmpfs {disk} || exit 97; "
        f"{sdpo_cli} > {tmp_path}/full.out 2>&1; echo $? > {tmp_path}/full.rc; "
        f"find {disk} > {tmp_path}/after-full.txt; "
        f"mount -o remount,size=64m {disk} && {sdpo_cli} > {tmp_path}/resumed.out 2>&1; echo $? > {tmp_path}/resumed.rc; "
        f"cp -a {disk}/runs {tmp_path}/runs"
    )
    env = run_env(prefect_server, COLUMNS="400")  # one traceback line per message line
    shell = subprocess.run(
        ["unshare", "-m", "sh", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    assert shell.returncode == 0, f"unshare/mount failed ({shell.returncode}): {shell.stderr}"
    # the traceback is wrapped at the console width, and torch prefixes each line with its rank
    full = "".join(line.removeprefix("[rank0]: ") for line in (tmp_path / "full.out").read_text().splitlines())
    assert (tmp_path / "full.rc").read_text().strip() != "0", full[-3000:]
    assert "No space left on device" in full, full[-3000:]
    assert f"file://{disk}/runs/{NAME}/" in full, full[-3000:]  # the error names the file
    assert ".tmp+" not in (tmp_path / "after-full.txt").read_text()
    resumed = (tmp_path / "resumed.out").read_text()
    assert (tmp_path / "resumed.rc").read_text().strip() == "0", resumed[-4000:]
    assert differences(reference, fingerprint(RunLayout(str(tmp_path / "runs"), NAME))) == []
    assert mlflow_steps(tmp_path / "mlflow.db") == EXPECTED_STEPS
