"""The Megatron training step under torchrun: data parallel 2 and tensor parallel 2 equal 1 process."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "integration" / "_scripts" / "train_step_worker.py"


def synthetic_teacher_columns(vocab: int, *, rows: int, k: int, seed: int) -> dict:
    """Teacher-shard columns with valid log-probabilities: what the trainer reads from Parquet."""
    rng = np.random.default_rng(seed)
    cols: dict[str, list] = {name: [] for name in (
        "sample_id", "prompt_ids", "response_ids", "topk_ids", "teacher_topk_logprobs",
        "teacher_sampled_logprobs", "sampled_logprobs", "advantage", "sample_mask")}
    for i in range(rows):
        p, t = int(rng.integers(3, 7)), int(rng.integers(1, 5))
        response = rng.integers(0, vocab, size=t)
        logits = rng.normal(size=(t, vocab)) * 2
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        top = np.argsort(-logp, axis=-1)[:, :k]
        cols["sample_id"].append(i)
        cols["prompt_ids"].append(rng.integers(0, vocab, size=p).tolist())
        cols["response_ids"].append(response.tolist())
        cols["topk_ids"].append(top.astype(np.int32))
        cols["teacher_topk_logprobs"].append(np.take_along_axis(logp, top, -1).astype(np.float32))
        cols["teacher_sampled_logprobs"].append(logp[np.arange(t), response].astype(np.float32))
        cols["sampled_logprobs"].append((logp[np.arange(t), response] - 0.1).astype(np.float32))
        cols["advantage"].append(float(rng.normal()))
        cols["sample_mask"].append(bool(i % 3))
    return cols


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tasks.bootstrap import build_model, build_tokenizer

    root = tmp_path_factory.mktemp("train_parallel")
    hf = root / "hf"
    tokenizer = build_tokenizer(hf)
    model = build_model(tokenizer, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, max_positions=64, seed=1)
    model.save_pretrained(hf)
    columns = synthetic_teacher_columns(len(tokenizer), rows=16, k=6, seed=0)
    path = root / "columns.pkl"
    path.write_bytes(pickle.dumps(columns))
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
