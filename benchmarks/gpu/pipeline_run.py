"""`sdpo run` on one GPU end to end, measured from what the run itself records.

    python -m benchmarks.gpu.pipeline_run --shape 0.6b --out /tmp/pipe [--iterations 3] [KEY=VALUE ...]

1. writes a random-init Qwen3 of `--shape` (benchmarks/gpu/common.py; bf16 safetensors, the Qwen3
   vocabulary of 151,936 ids) with the demo's character tokenizer padded to that vocabulary, so
   the run pays for the real LM head, top-K and logits;
2. runs `sdpo run benchmarks/gpu/pipeline.yaml model.path=... storage.root=... name=... KEY=VALUE`
   as a process: the CLI, the Prefect flow, the stage launchers, manifests, checkpoints, MLflow;
3. reads the run back: per-stage seconds and tokens/s from the iteration manifests' metrics, each
   iteration's wall time from the commit manifests' `created_at` (iteration n: commit n-1 to
   commit n), and the peak GPU memory from MLflow's `system/gpu_0_memory_usage_megabytes`.

Prints one `RESULT {json}` line per iteration and one for the run. Iteration 1 also holds
torch.compile's first compilation and the CUDA warm-up; iterations 2.. are the steady state.
`--timeout` stops the run (its whole process group, so no child keeps the GPU) after that many
seconds and reads back the iterations it committed.
A random-init model solves no prompt: every answer runs to `rollout.max_new_tokens`, and the
teacher sees the verifier's feedback (no peer solution) in its context.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu.common import PEAK_BF16_FLOPS, SHAPES, VOCAB, emit, qwen3_config

CONFIG = Path(__file__).with_name("pipeline.yaml")
COMPUTE = {  # stage -> (its stage seconds, its compute seconds, tokens/s of that compute)
    "rollout": ("rollout/stage_seconds", "rollout/seconds", "rollout/tokens_per_second"),
    "teacher": ("teacher/stage_seconds", "teacher/score_seconds", "teacher/tokens_per_second"),
    "train": ("train/stage_seconds", "train/seconds", "train/tokens_per_second"),
}


def write_policy(shape: str, out: Path, *, vocab: int = VOCAB) -> Path:
    """A random-init Qwen3 of `shape` in bf16 with the demo tokenizer padded to `vocab` ids."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tasks.data.bootstrap_model import build_tokenizer

    build_tokenizer(out)
    tokenizer_json = out / "tokenizer.json"
    spec = json.loads(tokenizer_json.read_text())
    used = set(spec["model"]["vocab"].values()) | {t["id"] for t in spec["added_tokens"]}
    if len(used) > vocab:
        raise ValueError(f"the demo tokenizer has {len(used)} ids, more than vocab={vocab}")
    # Unused ids as plain vocabulary entries: text never encodes to them (the pre-tokenizer splits
    # characters), a sampled one decodes to its placeholder.
    spec["model"]["vocab"].update({f"<|unused{i}|>": i for i in range(vocab) if i not in used})
    tokenizer_json.write_text(json.dumps(spec))
    config = Qwen3Config(
        vocab_size=vocab,
        max_position_embeddings=4096,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
        architectures=["Qwen3ForCausalLM"],
        **SHAPES[shape],
    )
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    return out


def _when(stamp: str) -> float:
    return dt.datetime.fromisoformat(stamp).timestamp()


def token_flops(shape: str, vocab: int) -> tuple[float, float]:
    """(2N, 2 L d_q) of the `shape` Qwen3: a token's forward FLOPs at sequence length S are
    2N + 2 L d_q S (N: parameters without the input embedding, the LM head included; the second
    term QK^T and AV over the causal half of the sequence), as benchmarks/gpu/common.py counts them."""
    import torch
    from transformers import Qwen3ForCausalLM

    config = qwen3_config(shape)
    config.vocab_size = vocab
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    n = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    return 2.0 * n, 2.0 * config.num_hidden_layers * config.num_attention_heads * config.head_dim


def read_run(root: str, name: str, *, tracking_uri: str, flops: tuple[float, float] | None = None) -> dict[str, Any]:
    """Per-iteration timings of a finished run, from its manifests and MLflow metrics; with `flops`
    (`token_flops`), the training and teacher MFU per GPU."""
    from mlflow.tracking import MlflowClient

    from storage.checkpoints import resolve_checkpoint
    from storage.layout import RunLayout
    from storage.manifest import iteration_committed, read_iteration_manifest

    layout = RunLayout(root, name)
    previous = _when(resolve_checkpoint(layout, 0, "policy").data["created_at"])
    iterations = []
    for n in sorted(i for i in layout.iterations() if i > 0 and iteration_committed(layout, i)):
        manifest = read_iteration_manifest(layout, n).data
        metrics, committed = manifest["metrics"], _when(manifest["created_at"])
        wall = committed - previous
        previous = committed
        row: dict[str, Any] = {"iteration": n, "wall_s": round(wall, 4)}
        # with pipelined commits the train stage's outputs are written beside the next iteration:
        # what the iteration waits for of it ends when its weights are handed over
        handover = metrics.get("train/handover_seconds", metrics["train/stage_seconds"])
        row["train_handover_s"] = round(handover, 4)
        row["train_beside_next_s"] = round(metrics["train/stage_seconds"] - handover, 4)
        staged = 0.0
        for stage, (stage_key, compute_key, rate_key) in COMPUTE.items():
            staged += handover if stage == "train" else metrics[stage_key]
            row[f"{stage}_stage_s"] = round(metrics[stage_key], 4)
            row[f"{stage}_compute_s"] = round(metrics[compute_key], 4)
            row[f"{stage}_tokens_per_s"] = round(metrics[rate_key])
        for stage in ("rollout", "teacher"):  # the stage's shards written, inside its stage seconds
            row[f"{stage}_write_s"] = round(metrics.get(f"{stage}/write_seconds", 0.0), 4)
            # waiting for the previous iteration's commit before its manifest (pipelined commits)
            row[f"{stage}_parent_wait_s"] = round(metrics.get(f"{stage}/parent_wait_seconds", 0.0), 4)
        row["outside_stages_s"] = round(wall - staged, 4)
        row["outside_stages_share"] = round((wall - staged) / wall, 4)
        compute = sum(metrics[c] for _, c, _ in COMPUTE.values())
        row["outside_compute_share"] = round((wall - compute) / wall, 4)
        # the train stage's critical part less the optimizer step, as a share of the iteration
        row["train_not_optimizer_share"] = round((handover - metrics["train/seconds"]) / wall, 4)
        row["megatron_save_s"] = round(metrics.get("train/megatron_save_seconds", 0.0), 2)
        row["megatron_upload_s"] = round(metrics.get("train/megatron_upload_seconds", 0.0), 2)
        # the train stage less training and the full-state save: HF export, EMA teacher, uploads
        row["train_outputs_s"] = round(
            metrics["train/stage_seconds"] - metrics["train/seconds"] - row["megatron_save_s"], 2
        )
        for part in ("export", "teacher_update", "upload_wait"):  # the train stage's outputs, part by part
            row[f"train_{part}_s"] = round(metrics.get(f"train/{part}_seconds", 0.0), 2)
        row["train_loss"] = metrics.get("train/loss")
        row["train_grad_norm"] = metrics.get("train/grad_norm")
        row["sample_mask_fraction"] = metrics.get("sdpo/sample_mask_fraction")
        row["response_length_mean"] = metrics["rollout/response_length_mean"]
        # processes (GPUs) per stage: the rollout runs in the flow's process, training and Megatron
        # teacher scoring on as many torchrun ranks as `launch.<stage>.nproc_per_node` x nnodes
        row["train_ranks"] = int(metrics["train/ranks"])
        row["teacher_ranks"] = int(metrics.get("teacher/ranks", 1.0))
        for stage in ("train", "teacher"):
            row[f"{stage}_tokens_per_s_per_gpu"] = round(metrics[f"{stage}/tokens_per_second"] / row[f"{stage}_ranks"])
        if flops is not None:
            # MFU per GPU: a token's FLOPs (2N + 2 L S d_q forward, 3x that trained) at the stage's mean
            # sequence length S, times the stage's tokens/s per GPU, over the GPU's dense bf16 peak
            base, attention = flops
            train_len = row["response_length_mean"]
            teacher_len = train_len + metrics.get("teacher/prompt_length_mean", 0.0)
            row["train_mfu"] = round(
                3 * (base + attention * train_len) * row["train_tokens_per_s_per_gpu"] / PEAK_BF16_FLOPS, 4
            )
            row["teacher_mfu"] = round(
                (base + attention * teacher_len) * row["teacher_tokens_per_s_per_gpu"] / PEAK_BF16_FLOPS, 4
            )
        iterations.append(row)

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name("sdpo")
    (mlflow_run,) = client.search_runs([experiment.experiment_id], filter_string=f"attributes.run_name = '{name}'")
    memory_keys = sorted(
        k for k in mlflow_run.data.metrics if k.startswith("system/gpu_") and "memory_usage_megabytes" in k
    )
    peaks = {k: max(m.value for m in client.get_metric_history(mlflow_run.info.run_id, k)) for k in memory_keys}
    return {"iterations": iterations, "peak_gpu_memory_mib": peaks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    parser.add_argument("--out", type=Path, required=True, help="a folder for the model, the run and its MLflow store")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--timeout", type=float, default=None, help="stop the run after this many seconds")
    parser.add_argument(
        "--read-only", action="store_true", help="only read back the run already under --out (its committed iterations)"
    )
    parser.add_argument("overrides", nargs="*", help="more dotted overrides for `sdpo run`")
    args = parser.parse_args()

    out = args.out.resolve()
    name = f"pipeline-{args.shape.replace('.', '_')}"
    tracking_uri = f"sqlite:///{out / 'mlflow.db'}"
    run_s = None
    if not args.read_only:
        policy = write_policy(args.shape, out / f"policy-{args.shape}", vocab=args.vocab)
        overrides = [
            f"name={name}",
            f"iterations={args.iterations}",
            f"model.path={policy}",
            f"storage.root={out / 'runs'}",
            f"storage.cache_dir={out / 'cache'}",
            f"tracking.uri={tracking_uri}",
            *args.overrides,
        ]
        env = {**os.environ, "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "2", "PREFECT_HOME": str(out / "prefect")}
        started = time.perf_counter()
        command = [sys.executable, "-m", "flows.cli", "run", str(CONFIG), *overrides]
        process = subprocess.Popen(command, env=env, start_new_session=True)
        try:
            code = process.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"stopping the run after {args.timeout} s; reading back what it committed", flush=True)
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        else:
            if code != 0:
                raise SystemExit(f"sdpo run exited with {code}")
            run_s = round(time.perf_counter() - started, 1)

    import torch

    # MFU only where the denominator (an H100/H200's dense bf16 peak) is the device's
    flops = token_flops(args.shape, args.vocab) if torch.cuda.is_available() else None
    result = read_run(str(out / "runs"), name, tracking_uri=tracking_uri, flops=flops)
    for row in result["iterations"]:
        emit({"bench": "pipeline_iteration", "shape": args.shape, **row})
    if not result["iterations"]:
        raise SystemExit(f"no iteration of {name} under {out} was committed")
    steady = [r for r in result["iterations"] if r["iteration"] > 1] or result["iterations"]
    mean = {
        k: round(sum(r[k] for r in steady) / len(steady), 4)
        for k in steady[0]
        if k.endswith(("_s", "_share", "_per_gpu", "_mfu"))
    }
    emit(
        {
            "bench": "pipeline",
            "shape": args.shape,
            "sdpo_run_s": run_s,
            "steady_iterations": len(steady),
            "steady_mean": mean,
            "peak_gpu_memory_mib": result["peak_gpu_memory_mib"],
            "overrides": args.overrides,
        }
    )


if __name__ == "__main__":
    main()
