"""torchrun worker for tests/integration/test_megatron_parallel.py (2 processes, gloo on CPU).

Runs, from the same HF folder and the same token batch:
- TP=2 (one data-parallel replica): loss, one Megatron DDP + optimizer step (clip_grad=1.0),
  loss after the step; the TP=2 model saved back as HF (before the step) and as a Megatron
  distributed checkpoint (after the step);
- DP=2 (TP=1): each rank steps on half the batch; the loss is then evaluated on the full batch.
Rank 0 writes the numbers as JSON. `train_step` is also imported by the test as the TP=1,
one-process reference, so both sides run the same procedure.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch


def token_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of `batch` [B, S+1] through Megatron's (vocab-parallel) CE."""
    inputs, labels = batch[:, :-1], batch[:, 1:]
    positions = torch.arange(inputs.shape[1]).expand_as(inputs)
    return model(inputs, positions, None, labels=labels).float().mean()  # [B, S] -> []


def train_step(
    hf_dir: Path, batch: torch.Tensor, *, eval_batch: torch.Tensor, save_dir: Path | None = None
) -> dict[str, float]:
    """Load HF weights, evaluate, take one clipped Adam step on `batch`, evaluate again."""
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from transformers import AutoConfig

    from tasks.megatron.convert import load_hf_into_megatron
    from tasks.megatron.hf_export import save_megatron_as_hf
    from tasks.megatron.model import build_gpt_model

    hf_config = AutoConfig.from_pretrained(hf_dir)
    model = build_gpt_model(hf_config)
    load_hf_into_megatron(model, hf_dir)
    if save_dir is not None:
        save_megatron_as_hf(model, hf_config, save_dir / "hf")
    with torch.no_grad():
        loss_before = token_loss(model, eval_batch).item()

    ddp = DistributedDataParallel(
        config=model.config,
        ddp_config=DistributedDataParallelConfig(overlap_grad_reduce=False),
        module=model,
    )
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0), [ddp])
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    token_loss(ddp, batch).backward()
    finalize_model_grads([ddp])
    ok, grad_norm, _ = optimizer.step()
    if not ok or not math.isfinite(grad_norm):
        raise RuntimeError(f"optimizer step failed: ok={ok} grad_norm={grad_norm}")
    with torch.no_grad():
        loss_after = token_loss(model, eval_batch).item()
    if save_dir is not None:
        (save_dir / "dist_ckpt").mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(model.sharded_state_dict(), str(save_dir / "dist_ckpt"))
    return {"loss_before": loss_before, "grad_norm": float(grad_norm), "loss_after": loss_after}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", type=Path, required=True)
    parser.add_argument("--batch", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from tasks.megatron.parallel import destroy_parallel, init_parallel

    batch = torch.load(args.batch)  # [B, S+1]
    results: dict[str, dict[str, float]] = {}

    layout = init_parallel(tensor_parallel=2, seed=0)
    assert (layout.tensor_parallel, layout.data_parallel) == (2, 1), layout
    results["tp2"] = train_step(args.hf_dir, batch, eval_batch=batch, save_dir=args.out / "tp2")

    layout = init_parallel(tensor_parallel=1, seed=0)
    assert (layout.tensor_parallel, layout.data_parallel) == (1, 2), layout
    half = batch.chunk(2)[layout.dp_rank]
    results["dp2"] = train_step(args.hf_dir, half, eval_batch=batch)

    if layout.rank == 0:
        (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    destroy_parallel()


if __name__ == "__main__":
    main()
