"""Megatron teacher scoring; run directly or under torchrun (CPU or GPU).

    python scorer_worker.py HF_DIR INPUTS.pkl OUT.pkl TENSOR_PARALLEL DTYPE [REFERENCE_DIR RATE]

INPUTS.pkl holds {"sequences": [(prompt_ids, response_ids)], "topk_ids": [array [T, K]]}; rank 0
writes the list of (topk_logprobs, sampled_logprobs, entropy) to OUT.pkl.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path


def main() -> None:
    import torch
    import torch.distributed as dist

    from tasks.megatron.parallel import destroy_parallel
    from tasks.megatron.scorer import MegatronTeacherScorer

    hf_dir, inputs, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    tp, dtype = int(sys.argv[4]), getattr(torch, sys.argv[5])
    reference, rate = (sys.argv[6], float(sys.argv[7])) if len(sys.argv) > 6 else (None, None)
    data = pickle.loads(inputs.read_bytes())
    scorer = MegatronTeacherScorer.from_hf(hf_dir, tensor_parallel=tp, dtype=dtype, reference_dir=reference)
    scores = scorer.score(
        sequences=data["sequences"],
        topk_ids=data["topk_ids"],
        batch_tokens=40,
        logit_chunk_tokens=7,
        trust_region_rate=rate,
    )
    if dist.get_rank() == 0:
        out.write_bytes(pickle.dumps([(s.topk_logprobs, s.sampled_logprobs, s.entropy) for s in scores]))
    destroy_parallel()  # every rank leaves its groups before exiting (tasks/megatron/parallel.py)


if __name__ == "__main__":
    main()
