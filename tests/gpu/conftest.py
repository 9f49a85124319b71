"""Fixtures of the GPU tests: a small random Qwen3 checkpoint (columns: tests/synthetic.py)."""

from __future__ import annotations

import pytest

VOCAB = 1024


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """A random bf16-friendly Qwen3 (head_dim 64, GQA 8/4) saved as an HF folder."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = tmp_path_factory.mktemp("tiny_qwen3")
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        architectures=["Qwen3ForCausalLM"],
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(out)
    return out
