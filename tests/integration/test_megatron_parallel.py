"""Tensor and data parallelism on CPU: 2 processes under torchrun (gloo) against 1 process.

One torchrun launch (tests/integration/_scripts/megatron_parallel_worker.py) runs TP=2 and then
DP=2 from the same tiny Qwen3 HF folder and token batch; this process runs the same
`train_step` at TP=1 on the full batch as the reference.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen3Config

from tasks.megatron.parallel import init_parallel

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parent / "_scripts" / "megatron_parallel_worker.py"
TOL = 1e-5


def _load_worker():
    spec = importlib.util.spec_from_file_location("megatron_parallel_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """A tiny Qwen3 HF folder and a [4, 17] token batch on disk."""
    root = tmp_path_factory.mktemp("megatron_parallel")
    config = Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "hf")
    tokens = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(1))
    torch.save(tokens, root / "batch.pt")
    return {"hf": root / "hf", "batch": root / "batch.pt", "out": root / "out"}


@pytest.fixture(scope="module")
def two_process_run(inputs) -> dict[str, dict[str, float]]:
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(WORKER), "--hf-dir", str(inputs["hf"]), "--batch", str(inputs["batch"]),
        "--out", str(inputs["out"]),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads((inputs["out"] / "results.json").read_text())


@pytest.fixture(scope="module")
def one_process_run(inputs) -> dict[str, float]:
    init_parallel(tensor_parallel=1, seed=0)
    tokens = torch.load(inputs["batch"])
    return _load_worker().train_step(inputs["hf"], tokens, eval_batch=tokens)


@pytest.mark.slow
@pytest.mark.parametrize("run", ["tp2", "dp2"])
def test_two_processes_match_one_process(two_process_run, one_process_run, run):
    """Same loss, same (clipped) grad norm, same loss after one Adam step."""
    for key in ("loss_before", "grad_norm", "loss_after"):
        assert two_process_run[run][key] == pytest.approx(one_process_run[key], abs=TOL), key
    assert one_process_run["grad_norm"] > 1.0  # clip_grad=1.0 was active
    assert one_process_run["loss_after"] < one_process_run["loss_before"]


@pytest.mark.slow
def test_tp2_export_to_hf_is_exact(two_process_run, inputs):
    original = load_file(inputs["hf"] / "model.safetensors")
    exported = load_file(inputs["out"] / "tp2" / "hf" / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    AutoModelForCausalLM.from_pretrained(inputs["out"] / "tp2" / "hf")


@pytest.mark.slow
def test_tp2_dist_checkpoint_loads_into_tp1(two_process_run, inputs):
    """A TP=2 checkpoint (after the step) reshards into a TP=1 model with the same loss."""
    from megatron.core import dist_checkpointing
    from transformers import AutoConfig

    from tasks.megatron.model import build_gpt_model

    init_parallel(tensor_parallel=1, seed=0)
    model = build_gpt_model(AutoConfig.from_pretrained(inputs["hf"]))
    checkpoint = str(inputs["out"] / "tp2" / "dist_ckpt")
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), checkpoint))
    tokens = torch.load(inputs["batch"])
    with torch.no_grad():
        loss = _load_worker().token_loss(model, tokens).item()
    assert loss == pytest.approx(two_process_run["tp2"]["loss_after"], abs=TOL)
