"""The demo policy's tokenizer and model: a character tokenizer and a tiny, randomly initialised causal LM.

The tokenizer is character-level, except that the fixed phrases of the chat template, the teacher
templates and the verifier's feedback are single tokens: teacher prompts then stay ~40 tokens
instead of ~170, which keeps warm-up and SDPO steps fast on a CPU. Any other text (including any
phrase if the templates change later) falls back to characters. `tasks.data.bootstrap` warms the
model up into the demo's base checkpoint.
"""

from __future__ import annotations

import logging
import re
import string
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "CHAT_TEMPLATE",
    "PAD_TOKEN",
    "IM_START",
    "IM_END",
    "UNK_TOKEN",
    "phrase_tokens",
    "prompt_ids",
    "bootstrap_vocabulary_size",
    "build_tokenizer",
    "build_model",
]

logger = logging.getLogger(__name__)

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END, UNK_TOKEN)
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n\t"
ROLES = ("system", "user", "assistant")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def phrase_tokens() -> list[str]:
    """Fixed phrases that get one token each: role names and the literal lines of the templates."""
    from sdpo_core import teacher_context as tc
    from sdpo_core.verifiers import arithmetic

    templates = [
        tc.SOLUTION_TEMPLATE,
        tc.FEEDBACK_TEMPLATE,
        tc.REPROMPT_TEMPLATE,
        tc.RELAX_SOLUTION_BLOCK,
        tc.RELAX_FEEDBACK_BLOCK,
        tc.RELAX_FINAL_LINE,
    ]
    phrases = list(ROLES)
    for template in templates:
        for piece in re.split(r"\{[A-Za-z_][A-Za-z0-9_]*\}", template):
            phrases += [line.strip() for line in piece.split("\n") if line.strip()]
    phrases += [arithmetic.WRONG_ANSWER, arithmetic.YOUR_OUTPUT, arithmetic.EXPECTED]
    phrases += [arithmetic.FORMAT_ERROR, arithmetic.TRUNCATED]
    return list(dict.fromkeys(p for p in phrases if len(p) > 1))


def bootstrap_vocabulary_size() -> int:
    """len() of the tokenizer `build_tokenizer` writes, without building it."""
    return len(SPECIAL_TOKENS) + len(CHARACTERS) + len(phrase_tokens())


def build_tokenizer(out_dir: str | Path) -> Any:
    """Write the demo tokenizer (with its ChatML-style chat template) to `out_dir`; return it reloaded.

    Vocabulary: the special tokens, every printable ASCII character plus space, newline and tab,
    and `phrase_tokens()`. Other characters map to `<unk>`. The returned tokenizer is the one read
    back by `AutoTokenizer`, so callers use exactly what is on disk.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *CHARACTERS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    core.add_tokens([AddedToken(p, special=False, normalized=False) for p in phrase_tokens()])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    return AutoTokenizer.from_pretrained(out_dir)


def prompt_ids(tokenizer: Any, messages: list[dict] | tuple[dict, ...]) -> list[int]:
    """Token ids of a chat prompt, ending in the assistant header."""
    out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, return_dict=True)
    return [int(i) for i in out["input_ids"]]


def build_model(
    tokenizer: Any,
    *,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    max_positions: int,
    seed: int,
    architecture: Literal["qwen3", "llama"] = "qwen3",
    tie_embeddings: bool = False,
) -> Any:
    """A randomly initialised causal LM sized for `tokenizer` (Qwen3 by default: it has q/k norms).

    Embeddings are untied by default so that weight conversion maps `lm_head` one to one. The
    global torch RNG is left as it was.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if hidden % heads or heads % kv_heads:
        raise ValueError(f"need hidden % heads == 0 and heads % kv_heads == 0, got {hidden=}, {heads=}, {kv_heads=}")
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    builders: dict[str, tuple[Any, Any]] = {
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
    }
    if architecture not in builders:
        raise ValueError(f"architecture must be 'qwen3' or 'llama', got {architecture!r}")
    config_class, cls = builders[architecture]
    config = config_class(**common)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    logger.info("built %s with %d parameters", cls.__name__, sum(p.numel() for p in model.parameters()))
    return model
