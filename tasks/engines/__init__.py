"""Rollout engines and the teacher scorer.

`base` defines the engine interface (`RolloutEngine`, `SamplingParams`, `Generation`);
`embedded` runs an HF model in process; the package `sglang` is the client of SGLang servers;
`scorer` runs teacher prefill. This package exports nothing: import from the module that holds a
name. Modules import torch/transformers lazily where they can, so importing one stays light.
"""
