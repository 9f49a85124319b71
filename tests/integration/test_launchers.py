"""Stage launchers: a stage in a fresh process or under torchrun leaves the run a stage in the flow's
process would (bit for bit, or within float tolerance where ranks reorder sums)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.integration.runs import (
    TINY,
    differences,
    fingerprint,
    forget_process_state,
    start_stage_worker,
    write_config,
)

REPO = Path(__file__).resolve().parents[2]
THREE = {**TINY, "iterations": 3, "eval": {"every": 2, "sampled_n": 2}}
ALL_SUBPROCESS = {stage: {"launcher": "subprocess"} for stage in ("rollout", "teacher", "train", "eval")}


def _run(tmp_path: Path, name: str, base: dict, **sections) -> object:
    from flows.run import sdpo_run
    from storage.layout import RunLayout

    forget_process_state()
    folder = tmp_path / name
    sdpo_run(str(write_config(folder, "placed", root=str(folder / "runs"), base=base, **sections)), [])
    return RunLayout(str(folder / "runs"), "placed")


@pytest.fixture(scope="module")
def inprocess(tmp_path_factory: pytest.TempPathFactory, prefect_server: str) -> dict:
    return fingerprint(_run(tmp_path_factory.mktemp("inprocess"), "a", THREE))


def test_subprocess_stages_equal_inprocess_stages_bit_for_bit(tmp_path, inprocess):
    placed = fingerprint(_run(tmp_path, "b", THREE, launch=ALL_SUBPROCESS))
    assert differences(inprocess, placed) == []


def test_a_killed_stage_process_fails_the_stage_and_the_next_attempt_resumes(tmp_path, inprocess, monkeypatch):
    from tasks.launch import StageProcessError

    monkeypatch.setenv("SDPO_CRASH_AT", "checkpoint.committed:policy@2")  # inherited by the stage process
    with pytest.raises(StageProcessError, match="stage train of iteration 2 .* exited with -9"):
        _run(tmp_path, "c", THREE, launch={"train": {"launcher": "subprocess"}})
    monkeypatch.delenv("SDPO_CRASH_AT")
    resumed = fingerprint(_run(tmp_path, "c", THREE, launch={"train": {"launcher": "subprocess"}}))
    assert differences(inprocess, resumed) == []


def _weights(layout: object, iteration: int) -> dict:
    from safetensors.torch import load_file

    from storage.cache import download_checkpoint

    folder = download_checkpoint(layout, iteration, "policy", cache_dir=str(Path(layout.local_dir).parent / "cache"))
    return load_file(str(folder / "model.safetensors"))


def _max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


ONE = {**TINY, "iterations": 1, "eval": {"every": 0, "sampled_n": 2}}


@pytest.mark.parametrize(
    ("name", "sections"),
    [
        ("dp2", {"launch": {"train": {"launcher": "torchrun", "nproc_per_node": 2}}}),
        (
            "tp2",
            {
                "train": {**TINY["train"], "tensor_parallel": 2},
                "teacher": {"backend": "megatron"},
                "launch": {
                    "train": {"launcher": "torchrun", "nproc_per_node": 2},
                    "teacher": {"launcher": "torchrun", "nproc_per_node": 2},
                },
            },
        ),
    ],
)
def test_torchrun_stages_train_like_one_process(tmp_path, prefect_server, name, sections):
    from storage.manifest import read_iteration_manifest

    single = _run(tmp_path, "single", ONE)
    spread = _run(tmp_path, name, ONE, **sections)
    a, b = read_iteration_manifest(single, 1).data["metrics"], read_iteration_manifest(spread, 1).data["metrics"]
    assert b["train/ranks"] == 2.0 and a["train/ranks"] == 1.0
    assert a["teacher/ranks"] == 1.0 and b["teacher/ranks"] == (2.0 if name == "tp2" else 1.0)
    assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5, abs=1e-7)
    base, one, other = _weights(single, 0), _weights(single, 1), _weights(spread, 1)
    assert _max_difference(base, _weights(spread, 0)) == 0.0
    # The same update: Adam's first step divides each gradient by its own magnitude, so an entry
    # whose gradient is near 0 turns the other reduction order's rounding into up to ~lr of
    # weight; the update as a whole must agree where a wrong reduction would be off by O(1).
    update = torch.cat([(one[k] - base[k]).flatten() for k in sorted(base)])
    apart = torch.cat([(other[k] - one[k]).flatten() for k in sorted(base)])
    print(
        f"{name}: max weight difference {float(apart.abs().max()):.3g}, relative {float(apart.norm() / update.norm()):.3g}"
    )
    assert float(apart.norm() / update.norm()) < 1e-3
    assert _max_difference(one, other) < 1e-4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_two_node_torchrun_on_loopback_runs_a_training_stage(tmp_path, prefect_server):
    """Two launches of the train stage with nnodes=2, one rank each, meeting at a rendezvous on
    127.0.0.1 (as two machines would): the stage commits, with the weights of one process."""
    from storage.layout import RunLayout
    from storage.manifest import read_stage_manifest, stage_done
    from tasks.config import load_config
    from tasks.launch import run_stage, stage_command
    from tasks.runtime import run_layout, start_run

    single = _run(tmp_path, "single", ONE)
    # the same run again, its stages up to the teacher run here; its train stage on the two "nodes"
    cfg = load_config(write_config(tmp_path / "staged", "placed", root=str(tmp_path / "staged" / "runs"), base=ONE))
    start_run(cfg, run_layout(cfg))
    for stage in ("prepare-base", "rollout", "teacher"):
        run_stage(stage, cfg.storage.root, "placed", 1)
    root = cfg.storage.root
    endpoint = f"127.0.0.1:{_free_port()}"
    spec = {"launcher": "torchrun", "nproc_per_node": 1, "nnodes": 2, "rdzv_endpoint": endpoint, "master_port": None}
    env = dict(os.environ, OMP_NUM_THREADS="1")
    nodes = [
        subprocess.Popen(
            stage_command("train", root, "placed", 1, {**spec, "node_rank": rank}),
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    done = RunLayout(root, "placed")
    assert stage_done(done, 1, "train")
    assert read_stage_manifest(done, 1, "train").data["metrics"]["train/ranks"] == 2.0
    assert _max_difference(_weights(single, 1), _weights(done, 1)) < 1e-5


def test_a_stage_on_a_prefect_work_pool_runs_on_a_real_process_worker(tmp_path, prefect_server):
    """The train stage as its own flow run of a `sdpo-stage` deployment, picked up by a real
    `prefect worker` of a process work pool on the test server: the run equals one trained in process."""
    deployment, worker = start_stage_worker(tmp_path, prefect_server)
    worker_log = tmp_path / "worker.log"
    try:
        single = fingerprint(_run(tmp_path, "single", ONE))
        pooled = fingerprint(
            _run(
                tmp_path,
                "pooled",
                ONE,
                launch={"train": {"launcher": "work-pool", "deployment": deployment, "timeout_s": 600}},
            )
        )
        # the worker reports the stage's flow run once that run's process has exited, which can be
        # after the pipeline has read the committed stage back
        deadline = time.monotonic() + 60
        while "placed/iter-0001/train" not in worker_log.read_text() and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        os.killpg(worker.pid, 9)
        worker.wait(timeout=30)
    log = worker_log.read_text()
    assert differences(single, pooled) == [], log[-3000:]
    assert "placed/iter-0001/train" in log, log[-3000:]  # the worker ran the stage's flow run


def test_a_stage_no_worker_takes_is_named_in_a_warning(tmp_path, prefect_server, monkeypatch):
    """A stage's flow run on a pool without a worker: the launcher names the pool and the command
    that serves it, then stops waiting at the stage's timeout."""
    from tasks import launch

    deployment, _ = start_stage_worker(tmp_path, prefect_server, start=False)
    pool = deployment.split("/")[1]
    monkeypatch.setattr(launch, "UNCLAIMED_WARNING_S", 1.0)
    spec = {"launcher": "work-pool", "deployment": deployment, "timeout_s": 4}
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("tasks.launch").addHandler(handler)  # Prefect's logging config keeps caplog's away
    try:
        with pytest.raises(
            launch.StageProcessError,
            match=r"flow run nobody/iter-0001/train .* did not end within launch.train.timeout_s=4 \(it is (Scheduled|Late)\)",
        ):
            launch.launch_stage("train", str(tmp_path / "runs"), "nobody", 1, spec)
    finally:
        logging.getLogger("tasks.launch").removeHandler(handler)
    (warning,) = [w for w in warnings if "for a worker of work pool" in w]
    assert f"work pool '{pool}'" in warning and f"prefect worker start --pool {pool}" in warning, warning


def test_a_stage_process_past_its_timeout_is_killed_and_the_stage_fails(tmp_path, prefect_server):
    from storage.layout import RunLayout
    from storage.manifest import stage_done
    from tasks.launch import StageProcessError

    with pytest.raises(StageProcessError, match=r"ran past launch.rollout.timeout_s=0.5 and was killed"):
        _run(tmp_path, "slow", ONE, launch={"rollout": {"launcher": "subprocess", "timeout_s": 0.5}})
    layout = RunLayout(str(tmp_path / "slow" / "runs"), "placed")
    assert not stage_done(layout, 1, "rollout")
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(tmp_path / "slow") not in ps  # no stage process left running


_GROUP_PROBE = """
import types

import torch
import torch.distributed as dist

import tasks.launch
import tasks.preload
import tasks.runtime
from flows.cli import app


def body(stage, root, run, iteration):
    dist.init_process_group("gloo")  # torchrun's env:// rendezvous, as a training stage joins it
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()}: sum {int(total)}", flush=True)


tasks.runtime.open_run = lambda root, run: types.SimpleNamespace(cfg=None)  # no run to read: the body needs none
tasks.preload.imports_of = lambda name, cfg: []
tasks.launch.run_stage = body
try:
    app(["stage", "train", "--root", "/nowhere", "--run-name", "r", "--iteration", "1"])
except SystemExit as done:
    assert done.code in (0, None), done.code
print(f"group up after the stage: {dist.is_initialized()}", flush=True)
"""


def test_every_torchrun_rank_of_a_stage_leaves_its_process_group_before_exiting(tmp_path):
    """`sdpo stage` tears the stage body's process group down (a barrier, then Megatron's groups and
    torch.distributed's) before the interpreter exits: a rank that exits with a gloo group up can
    abort in its destructor."""
    probe = tmp_path / "probe.py"
    probe.write_text(_GROUP_PROBE)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(probe)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count(": sum 2") == 2, done.stdout
    assert done.stdout.count("group up after the stage: False") == 2, done.stdout
