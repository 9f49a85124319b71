"""One training iteration of the Megatron trainer; run directly or under torchrun.

python train_step_worker.py HF_DIR COLUMNS.pkl OUT_DIR TENSOR_PARALLEL
"""

from __future__ import annotations

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

    hf_dir, columns_path, out_dir, tp = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    columns = pickle.loads(columns_path.read_bytes())
    cfg = build_config(
        {
            "iterations": 1,
            "data": {"prompts_per_iteration": 4},
            "rollout": {"group_size": 4},
            "train": {"steps_per_iteration": 1, "micro_batch_size": 3, "tensor_parallel": tp},
            "optimizer": {"lr": 1e-2},
            "loss": {"type": "blend", "blend_lambda": 0.3, "mask_reduction": "exclude"},
        }
    )
    trainer = MegatronTrainer(cfg, hf_dir)
    metrics = trainer.train_iteration(columns, iteration=1)
    trainer.save_hf(out_dir / "hf", AutoTokenizer.from_pretrained(hf_dir))
    if dist.get_rank() == 0:
        (out_dir / "metrics.json").write_text(json.dumps(metrics))
    destroy_parallel()  # every rank leaves its groups before exiting (tasks/megatron/parallel.py)


if __name__ == "__main__":
    main()
