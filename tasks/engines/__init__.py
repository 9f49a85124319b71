"""Rollout engines and the teacher scorer.

`base` defines the engine interface (`RolloutEngine`, `Generation`); `embedded` runs an HF model in
process; `scorer` runs teacher prefill. Modules import torch/transformers lazily where they can, so
importing this package stays light.
"""

from tasks.engines.base import FinishReason, Generation, RolloutEngine

__all__ = ["FinishReason", "Generation", "RolloutEngine"]
