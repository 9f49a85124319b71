"""A from-scratch demo policy: character tokenizer, tiny causal LM, and a short supervised warm-up.

The warm-up makes the self-teacher much stronger than the student, which is the gap SDPO distils.
It trains on three kinds of examples, with the loss on the answer tokens only:

- plain prompts ("37+45=" -> "82"): the student format; few of them, so the student learns the
  shape of an answer (digits, then the end-of-turn token) but not yet addition;
- teacher prompts holding a peer's correct solution, rendered with the SDPO teacher templates;
- teacher prompts holding the verifier's wrong-answer feedback ("... Expected: 82.").

Reading the answer out of the context is learnt in a few hundred steps, addition is not; so the
teacher's greedy accuracy ends high while the student's stays low.

The tokenizer is character-level, except that the fixed phrases of the chat template, the teacher
templates and the verifier's feedback are single tokens: teacher prompts then stay ~40 tokens
instead of ~170, which keeps warm-up and SDPO steps fast on a CPU. Any other text (including any
phrase if the templates change later) falls back to characters.
"""

from __future__ import annotations

import logging
import math
import random
import re
import string
import time
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "CHAT_TEMPLATE",
    "PAD_TOKEN",
    "IM_START",
    "IM_END",
    "UNK_TOKEN",
    "DEFAULT_WARMUP_MIX",
    "phrase_tokens",
    "prompt_ids",
    "bootstrap_vocabulary_size",
    "build_tokenizer",
    "build_model",
    "wrong_answer",
    "warmup_messages",
    "warm_up",
    "greedy_accuracies",
    "bootstrap_checkpoint",
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

WarmupKind = Literal["plain", "solution", "feedback"]
WARMUP_KINDS: tuple[WarmupKind, ...] = ("plain", "solution", "feedback")
# Few plain examples: enough for the answer format, too few to learn addition within the warm-up.
DEFAULT_WARMUP_MIX: dict[str, float] = {"plain": 0.15, "solution": 0.35, "feedback": 0.5}


# --------------------------------------------------------------------------- tokenizer


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


# --------------------------------------------------------------------------- model


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
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

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
    if architecture == "qwen3":
        config, cls = Qwen3Config(**common), Qwen3ForCausalLM
    elif architecture == "llama":
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    else:
        raise ValueError(f"architecture must be 'qwen3' or 'llama', got {architecture!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    logger.info("built %s with %d parameters", cls.__name__, sum(p.numel() for p in model.parameters()))
    return model


# --------------------------------------------------------------------------- warm-up data


def wrong_answer(label: int, rng: random.Random) -> int:
    """A plausible wrong non-negative answer: near the label half of the time, else anywhere nearby."""
    while True:
        if rng.random() < 0.5:
            guess = label + rng.choice([-1, 1]) * rng.randint(1, 10)
        else:
            guess = rng.randint(0, 2 * label + 10)
        if guess != label and guess >= 0:
            return guess


def warmup_messages(row: dict, kind: WarmupKind, rng: random.Random) -> tuple[dict, ...]:
    """The prompt messages of one warm-up example of `kind`, built like the SDPO teacher builds them."""
    from sdpo_core.teacher_context import build_teacher_messages
    from sdpo_core.verifiers.arithmetic import verify

    messages = row["prompt_messages"]
    if kind == "plain":
        return tuple(messages)
    if kind == "solution":
        return build_teacher_messages(messages, solution=row["label"], feedback=None)
    if kind == "feedback":
        guess = wrong_answer(int(row["label"]), rng)
        verdict = verify(str(guess), row["label"], truncated=False)
        return build_teacher_messages(messages, solution=None, feedback=verdict.feedback)
    raise ValueError(f"warm-up kind must be one of {WARMUP_KINDS}, got {kind!r}")


def _batch(tokenizer: Any, examples: list[tuple[list[int], list[int]]]) -> dict[str, Any]:
    """Right-padded input ids, attention mask and labels (-100 outside the answer) for a batch."""
    import torch

    width = max(len(p) + len(a) for p, a in examples)
    input_ids = torch.full((len(examples), width), tokenizer.pad_token_id, dtype=torch.long)  # [B, L]
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for row, (prompt, answer) in enumerate(examples):
        ids = prompt + answer
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        labels[row, len(prompt) : len(ids)] = torch.tensor(answer)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def warm_up(
    model: Any,
    tokenizer: Any,
    data: list[dict],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    mix: dict[str, float] | None = None,
    num_threads: int | None = None,
    progress: bool = True,
) -> dict[str, float]:
    """Supervised warm-up on `data` rows (prompt_messages, label); trains `model` in place.

    Each example's kind is drawn with weights `mix` (default `DEFAULT_WARMUP_MIX`). The answer is the label followed by the end-of-turn token. AdamW with a linear warm-up
    over the first 5% of steps, then cosine decay to 10% of `lr`. `num_threads` sets torch's
    intra-op threads for the duration (restored afterwards). Returns `bootstrap/*` metrics.
    """
    import torch
    from tqdm.auto import tqdm

    if steps < 0 or batch_size < 1 or lr <= 0:
        raise ValueError(f"need steps >= 0, batch_size >= 1, lr > 0; got {steps=}, {batch_size=}, {lr=}")
    if not data:
        raise ValueError("warm-up data is empty")
    weights = dict(DEFAULT_WARMUP_MIX if mix is None else mix)
    unknown = sorted(set(weights) - set(WARMUP_KINDS))
    if unknown or any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
        raise ValueError(f"mix must map a subset of {WARMUP_KINDS} to non-negative weights with a positive sum, got {weights}")
    kinds = [k for k in WARMUP_KINDS if weights.get(k, 0) > 0]
    kind_weights = [weights[k] for k in kinds]

    previous_threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    rng = random.Random(seed)
    plain_cache: dict[str, list[int]] = {}
    answer_cache: dict[str, list[int]] = {}
    eos = [int(tokenizer.eos_token_id)]

    def example(row: dict) -> tuple[list[int], list[int]]:
        kind = rng.choices(kinds, weights=kind_weights)[0]
        if kind == "plain":
            if row["prompt_id"] not in plain_cache:
                plain_cache[row["prompt_id"]] = prompt_ids(tokenizer, row["prompt_messages"])
            prompt = plain_cache[row["prompt_id"]]
        else:
            prompt = prompt_ids(tokenizer, warmup_messages(row, kind, rng))
        if row["label"] not in answer_cache:
            answer_cache[row["label"]] = tokenizer.encode(row["label"], add_special_tokens=False) + eos
        return prompt, answer_cache[row["label"]]

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    warm = max(1, steps // 20)

    def lr_factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress_fraction = (step - warm) / max(1, steps - warm)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress_fraction))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model.train()
    losses: list[float] = []
    tokens = 0
    started = time.perf_counter()
    try:
        with tqdm(range(steps), desc="warm-up", unit="step", disable=not progress) as bar:
            for _ in bar:
                batch = _batch(tokenizer, [example(rng.choice(data)) for _ in range(batch_size)])
                loss = model(**batch).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(float(loss.detach()))
                tokens += int(batch["attention_mask"].sum())
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
    finally:
        model.eval()
        torch.set_num_threads(previous_threads)
    seconds = time.perf_counter() - started
    tail = losses[-max(1, len(losses) // 10) :] if losses else [float("nan")]
    return {
        "bootstrap/warmup_steps": float(steps),
        "bootstrap/warmup_seconds": seconds,
        "bootstrap/warmup_loss_first": losses[0] if losses else float("nan"),
        "bootstrap/warmup_loss_last": sum(tail) / len(tail),
        "bootstrap/warmup_tokens_per_second": tokens / max(seconds, 1e-9),
    }


# --------------------------------------------------------------------------- measurement


def greedy_accuracies(
    checkpoint_dir: str | Path, rows: list[dict], *, seed: int, max_new_tokens: int = 8, batch_size: int = 256
) -> dict[str, float]:
    """Greedy accuracy of a saved checkpoint on `rows` as the student (plain) and as the teacher.

    Teacher formats: with a correct solution in context, and with wrong-answer feedback in context
    (a seeded wrong guess). This is the gap SDPO distils; it is measured through the embedded
    engine, so it also checks that the checkpoint loads.
    """
    from transformers import AutoTokenizer

    from sdpo_core.verifiers.arithmetic import verify
    from tasks.engines.embedded import EmbeddedEngine

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint_dir))
    engine = EmbeddedEngine(str(checkpoint_dir), max_batch_size=batch_size)
    rng = random.Random(seed)
    out = {}
    try:
        for kind in WARMUP_KINDS:
            prompts = [prompt_ids(tokenizer, warmup_messages(row, kind, rng)) for row in rows]
            generations = engine.generate(
                prompts,
                n=1,
                temperature=0.0,
                top_p=1.0,
                max_new_tokens=max_new_tokens,
                stop_token_ids=[int(tokenizer.eos_token_id)],
                top_k_logprobs=1,
                seed=seed,
            )
            rewards = [
                verify(
                    tokenizer.decode(group[0].response_ids, skip_special_tokens=True),
                    row["label"],
                    truncated=group[0].finish_reason == "length",
                ).reward
                for row, group in zip(rows, generations, strict=True)
            ]
            name = "plain" if kind == "plain" else f"teacher_{kind}"
            out[f"bootstrap/{name}_accuracy"] = sum(rewards) / len(rewards)
    finally:
        engine.close()
    return out


def bootstrap_checkpoint(
    out_dir: str | Path,
    *,
    train_rows: list[dict],
    eval_rows: list[dict],
    seed: int,
    steps: int,
    batch_size: int,
    lr: float,
    architecture: Literal["qwen3", "llama"],
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    max_positions: int,
    num_eval: int,
    mix: dict[str, float] | None = None,
    num_threads: int | None = None,
    progress: bool = True,
) -> dict[str, float]:
    """Build, warm up and save the demo policy as an HF folder; return warm-up and accuracy metrics.

    `out_dir` receives config.json, model.safetensors and the tokenizer files (with the chat
    template), loadable with `AutoModelForCausalLM` / `AutoTokenizer`. Accuracies are greedy, on
    the first `num_eval` of `eval_rows` (problems the warm-up never saw).
    """
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(out_dir)
    model = build_model(
        tokenizer,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate,
        max_positions=max_positions,
        seed=seed,
        architecture=architecture,
    )
    metrics = warm_up(
        model,
        tokenizer,
        train_rows,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        mix=mix,
        num_threads=num_threads,
        progress=progress,
    )
    model.save_pretrained(out_dir)
    metrics["bootstrap/parameters"] = float(sum(p.numel() for p in model.parameters()))
    metrics.update(greedy_accuracies(out_dir, eval_rows[:num_eval], seed=seed))
    logger.info("bootstrap checkpoint written to %s: %s", out_dir, metrics)
    return metrics
