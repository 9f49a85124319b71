"""`sdpo run` on CUDA, one iteration of the GPU configuration (benchmarks/gpu/pipeline.yaml) on a
tiny random Qwen3: bf16, packed, chunked compiled loss, fused kernels, Megatron teacher, the
embedded engine on the GPU, the EMA teacher. Run through benchmarks/gpu/pipeline_run.py, the same
command path as the GPU pipeline benchmark."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REPO = Path(__file__).resolve().parents[2]
SMALL = [  # the GPU configuration at a size a test can afford
    "data.prompts_per_iteration=8",
    "data.eval_prompts=2",
    "rollout.group_size=4",
    "rollout.max_new_tokens=32",
    "rollout.top_k=16",
    "rollout.batch_size=32",
    "teacher.batch_tokens=2048",
    "train.pack_tokens=1024",
    "train.loss_chunk_tokens=256",
    "optimizer.lr=1e-4",
]


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
# the train stage on two GPUs through the pipeline's own torchrun launcher: data parallel, or tensor
# parallel with the Megatron teacher scorer under the same two ranks
TWO_GPUS = {
    "dp2": ["launch.train.launcher=torchrun", "launch.train.nproc_per_node=2"],
    "tp2": [
        "train.tensor_parallel=2",
        "launch.train.launcher=torchrun",
        "launch.train.nproc_per_node=2",
        "launch.teacher.launcher=torchrun",
        "launch.teacher.nproc_per_node=2",
    ],
}


def pipeline_run(out: Path, *overrides: str, timeout: float = 400) -> dict:
    """One iteration of `benchmarks/gpu/pipeline_run.py` on the tiny GPU shape; its RESULT records by kind."""
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.gpu.pipeline_run",
        "--shape",
        "tiny-gpu",
        "--vocab",
        "1024",
        "--iterations",
        "1",
        "--out",
        str(out),
        *SMALL,
        *overrides,
    ]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    results = [
        json.loads(line.removeprefix("RESULT ")) for line in done.stdout.splitlines() if line.startswith("RESULT ")
    ]
    return {r["bench"]: r for r in results}


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline")
    return out, pipeline_run(out)


def test_one_iteration_of_sdpo_run_on_cuda_is_committed_and_measured(gpu_run):
    out, results = gpu_run
    (row,) = [results["pipeline_iteration"]]
    assert row["iteration"] == 1
    for stage in ("rollout", "teacher", "train"):
        assert 0 < row[f"{stage}_compute_s"] <= row[f"{stage}_stage_s"] < row["wall_s"]
        assert row[f"{stage}_tokens_per_s"] > 0
    assert 0 < row["outside_stages_share"] < 1
    assert row["sample_mask_fraction"] > 0 and torch.isfinite(torch.tensor(row["train_loss"]))
    peaks = results["pipeline"]["peak_gpu_memory_mib"]
    assert peaks and all(v > 0 for v in peaks.values())  # MLflow sampled the GPU during the run


def test_the_embedded_engine_samples_on_the_gpu_in_bf16(gpu_run):
    from tasks.rollout import get_engine
    from tasks.runtime import checkpoint_dir, open_run

    out, _ = gpu_run
    run = open_run(str(out / "runs"), "pipeline-tiny-gpu")
    engine = get_engine(run.cfg.rollout, checkpoint_dir(run, 1, "policy"), cache_key="test")
    weight = next(engine.model.parameters())
    assert (weight.device.type, weight.dtype) == ("cuda", torch.bfloat16)


def test_the_ema_teacher_of_the_bf16_policy_moves_as_in_float32(gpu_run):
    """teacher_1 = teacher_0 + tau (student_1 - teacher_0), computed in float32 from the bf16 policy
    the GPU trained; a bf16 teacher would round most of these moves away."""
    from safetensors.torch import load_file

    from tasks.runtime import checkpoint_dir, open_run

    out, _ = gpu_run
    run = open_run(str(out / "runs"), "pipeline-tiny-gpu")
    tau = run.cfg.teacher.update_rate
    base = load_file(str(checkpoint_dir(run, 0, "policy") / "model.safetensors"))
    student = load_file(str(checkpoint_dir(run, 1, "policy") / "model.safetensors"))
    teacher = load_file(str(checkpoint_dir(run, 1, "teacher") / "model.safetensors"))
    moved = in_bf16_moved = changed = 0
    for name, t1 in teacher.items():
        assert t1.dtype == torch.float32, name
        assert student[name].dtype == torch.bfloat16, name
        t0, s1 = base[name].double(), student[name].double()
        expected = t0 + tau * (s1 - t0)
        # float32 rounding of the update's two terms (the sum may cancel to near zero)
        assert ((t1.double() - expected).abs() <= 4e-7 * (t0.abs() + tau * (s1 - t0).abs())).all(), name
        delta = s1 != t0
        changed += int(delta.sum())
        moved += int((t1.double() != t0)[delta].sum())
        in_bf16_moved += int((expected.to(torch.bfloat16).double() != t0)[delta].sum())
    assert changed > 0  # the GPU step moved the bf16 policy
    assert moved / changed > 0.99
    assert in_bf16_moved / changed < 0.5  # what keeping the teacher in float32 prevents


@two_gpus
@pytest.mark.parametrize("layout", sorted(TWO_GPUS))
def test_sdpo_run_on_two_gpus_trains_like_one_gpu(gpu_run, tmp_path, layout):
    """`sdpo run` launching its train stage (and, tensor parallel, its teacher stage) on two GPUs
    under torchrun: the same samples as on one GPU, and the first step's loss and gradient norm
    within bf16 tolerance of the one-GPU run's. On a random-init model the teacher differs from the
    student by its context only, so the loss is small (about 1e-5 in float32 on the CPU) and bf16
    rounding in another summation order is a larger share of it than in tests/gpu/test_gpu_train.py;
    a reduction over the ranks that sums where it should average, or ranks that train on the wrong
    samples, moves both by far more than 5 %."""
    one = gpu_run[1]["pipeline_iteration"]
    two = pipeline_run(tmp_path, *TWO_GPUS[layout], timeout=600)["pipeline_iteration"]
    print(layout, {k: two[k] for k in two if k.endswith(("_loss", "_norm", "_ranks", "_per_gpu", "_mfu"))})
    assert (two["train_ranks"], two["teacher_ranks"]) == (2, 2 if layout == "tp2" else 1)
    assert two["response_length_mean"] == one["response_length_mean"]  # the rollout ran alike on GPU 0
    assert two["train_loss"] == pytest.approx(one["train_loss"], rel=5e-2)
    assert two["train_grad_norm"] == pytest.approx(one["train_grad_norm"], rel=5e-2)
