"""The Megatron training step under torchrun: data parallel 2 and tensor parallel 2 equal 1 process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.synthetic import write_training_inputs

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "integration" / "_scripts" / "train_step_worker.py"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_parallel")
    hf, path, _ = write_training_inputs(root)
    return root, hf, path


def run_worker(root: Path, hf: Path, columns: Path, name: str, *, nproc: int, tp: int) -> tuple[dict, dict]:
    out = root / name
    out.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    args = [str(WORKER), str(hf), str(columns), str(out), str(tp)]
    if nproc == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    from safetensors.torch import load_file

    return json.loads((out / "metrics.json").read_text()), load_file(str(out / "hf" / "model.safetensors"))


def test_data_and_tensor_parallel_steps_equal_the_single_process_step(setup):
    root, hf, columns = setup
    single, w1 = run_worker(root, hf, columns, "single", nproc=1, tp=1)
    dp2, w_dp = run_worker(root, hf, columns, "dp2", nproc=2, tp=1)
    tp2, w_tp = run_worker(root, hf, columns, "tp2", nproc=2, tp=2)

    for other in (dp2, tp2):
        assert other["train/loss"] == pytest.approx(single["train/loss"], rel=1e-5, abs=1e-7)
        assert other["train/grad_norm"] == pytest.approx(single["train/grad_norm"], rel=1e-4)
    from safetensors.torch import load_file

    before = load_file(str(hf / "model.safetensors"))
    moved = max(float((w1[k] - before[k]).abs().max()) for k in w1)
    assert moved > 1e-4  # the step changed the weights
    # Adam moves every weight by about lr = 1e-2; a wrong reduction or shard shows at that scale,
    # while float reordering across ranks can shift a near-zero gradient's step by far less.
    for weights in (w_dp, w_tp):
        assert set(weights) == set(w1)
        for key in w1:
            torch.testing.assert_close(weights[key], w1[key], rtol=1e-4, atol=2e-4)
