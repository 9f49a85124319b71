"""The demo policy's supervised warm-up, and `bootstrap_checkpoint`, which builds, warms up and saves it.

The model and its tokenizer are `tasks.data.bootstrap_model`'s. The warm-up makes the
self-teacher much stronger than the student, which is the gap SDPO distils. It trains on three
kinds of examples, with the loss on the answer tokens only:

- plain prompts ("37+45=" -> "82"): the student format; few of them, so the student learns the
  shape of an answer (digits, then the end-of-turn token) but not yet addition;
- teacher prompts holding a peer's correct solution, rendered with the SDPO teacher templates;
- teacher prompts holding the verifier's wrong-answer feedback ("... Expected: 82.").

Reading the answer out of the context is learnt in a few hundred steps, addition is not; so the
teacher's greedy accuracy ends high while the student's stays low.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tasks.data.bootstrap_model import build_model, build_tokenizer, prompt_ids

__all__ = [
    "WarmupSchedule",
    "wrong_answer",
    "warmup_messages",
    "warm_up",
    "greedy_accuracies",
    "bootstrap_checkpoint",
]

logger = logging.getLogger(__name__)

WarmupKind = Literal["plain", "solution", "feedback"]
WARMUP_KINDS: tuple[WarmupKind, ...] = ("plain", "solution", "feedback")
# Few plain examples: enough for the answer format, too few to learn addition within the warm-up.


@dataclass(frozen=True, kw_only=True)
class WarmupSchedule:
    """How long and how hard the warm-up trains, and its mix of example kinds (checked here)."""

    steps: int
    batch_size: int
    lr: float
    mix: dict[str, float]

    def __post_init__(self) -> None:
        if self.steps < 0 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError(
                f"need steps >= 0, batch_size >= 1, lr > 0; got steps={self.steps}, "
                f"batch_size={self.batch_size}, lr={self.lr}"
            )
        unknown = sorted(set(self.mix) - set(WARMUP_KINDS))
        if unknown or any(w < 0 for w in self.mix.values()) or sum(self.mix.values()) <= 0:
            raise ValueError(
                f"mix must map a subset of {WARMUP_KINDS} to non-negative weights with a positive sum, got {self.mix}"
            )


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
    schedule: WarmupSchedule,
    *,
    seed: int,
    num_threads: int | None = None,
    progress: bool = True,
) -> dict[str, float]:
    """Supervised warm-up on `data` rows (prompt_messages, label); trains `model` in place.

    Each example's kind is drawn with weights `schedule.mix`. The answer is the label followed by
    the end-of-turn token. AdamW with a linear warm-up over the first 5% of `schedule.steps`, then
    cosine decay to 10% of `schedule.lr`. `num_threads` sets torch's intra-op threads for the
    duration (restored afterwards). Returns `bootstrap/*` metrics.
    """
    import torch
    from tqdm.auto import tqdm

    from tasks.progress_bars import bar_disabled

    if not data:
        raise ValueError("warm-up data is empty")
    steps, batch_size, lr = schedule.steps, schedule.batch_size, schedule.lr
    kinds = [k for k in WARMUP_KINDS if schedule.mix.get(k, 0) > 0]
    kind_weights = [schedule.mix[k] for k in kinds]

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
        with tqdm(range(steps), desc="warm-up", unit="step", disable=bar_disabled(progress)) as bar:
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
    mix: dict[str, float],
    num_threads: int | None = None,
    progress: bool = True,
) -> dict[str, float]:
    """Build, warm up and save the demo policy as an HF folder; return warm-up and accuracy metrics.

    `out_dir` receives config.json, model.safetensors and the tokenizer files (with the chat
    template), loadable with `AutoModelForCausalLM` / `AutoTokenizer`. Accuracies are greedy, on
    the first `num_eval` of `eval_rows` (problems the warm-up never saw).
    """
    schedule = WarmupSchedule(steps=steps, batch_size=batch_size, lr=lr, mix=dict(mix))
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
    metrics = warm_up(model, tokenizer, train_rows, schedule, seed=seed, num_threads=num_threads, progress=progress)
    model.save_pretrained(out_dir)
    metrics["bootstrap/parameters"] = float(sum(p.numel() for p in model.parameters()))
    metrics.update(greedy_accuracies(out_dir, eval_rows[:num_eval], seed=seed))
    logger.info("bootstrap checkpoint written to %s: %s", out_dir, metrics)
    return metrics
