"""One training iteration with config overrides; run directly or under torchrun (CPU or GPU).

    python train_variant_worker.py HF_DIR COLUMNS.pkl OUT_DIR 'JSON overrides of the run config'

Writes OUT_DIR/metrics.json (rank 0; with `weights_sha256`, a digest of rank 0's trained weights)
and OUT_DIR/hf (the trained weights, when HF_DIR has a tokenizer).
"""

from __future__ import annotations

import hashlib
import json
import pickle
import sys
from pathlib import Path


def main() -> None:
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from tasks.config import build_config
    from tasks.megatron.parallel import destroy_parallel
    from tasks.megatron.trainer import MegatronTrainer

    hf_dir, columns_path, out_dir = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    overrides = json.loads(sys.argv[4])
    columns = pickle.loads(columns_path.read_bytes())
    tree = {
        "iterations": 1,
        "data": {"prompts_per_iteration": 4},
        "rollout": {"group_size": 4},
        "train": {"steps_per_iteration": 1, "micro_batch_size": 3},
        "optimizer": {"lr": 1e-2},
        "loss": {"type": "blend", "blend_lambda": 0.3, "mask_reduction": "exclude"},
    }
    for section, values in overrides.items():
        tree.setdefault(section, {}).update(values)
    trainer = MegatronTrainer(build_config(tree), hf_dir)
    metrics = trainer.train_iteration(columns, iteration=1)
    if (hf_dir / "tokenizer_config.json").is_file():  # the GPU tests' random checkpoints have no tokenizer
        trainer.save_hf(out_dir / "hf", AutoTokenizer.from_pretrained(hf_dir))
    if dist.get_rank() == 0:
        (out_dir / "metrics.json").write_text(json.dumps({**metrics, "weights_sha256": weights_digest(trainer)}))
    destroy_parallel()  # every rank leaves its groups before exiting (tasks/megatron/parallel.py)


def weights_digest(trainer) -> str:
    """sha256 of this rank's parameters, by name, over their bytes."""
    import torch

    h = hashlib.sha256()
    for name, param in sorted(trainer.model.module.named_parameters()):
        h.update(name.encode())
        h.update(param.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


if __name__ == "__main__":
    main()
