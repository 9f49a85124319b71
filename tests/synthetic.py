"""Synthetic teacher-shard columns and tiny model configs shared by the CPU and GPU tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def tiny_qwen3_config(vocab_size: int):
    """A 2-layer Qwen3 HF config (hidden 32, 4/2 heads of 8, 128 positions, untied embeddings)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        architectures=["Qwen3ForCausalLM"],
    )


def synthetic_scoring_inputs(
    vocab: int, *, count: int, k: int, seed: int, prompt: tuple[int, int], response: tuple[int, int]
) -> tuple[list[tuple[list[int], list[int]]], list[np.ndarray]]:
    """Random (prompt_ids, response_ids) pairs with K distinct candidate ids per response token, as
    the teacher scorers take them; lengths are drawn from the half-open ranges `prompt`, `response`."""
    rng = np.random.default_rng(seed)
    sequences, topk = [], []
    for _ in range(count):
        prompt_ids = rng.integers(0, vocab, size=int(rng.integers(*prompt))).tolist()
        response_ids = rng.integers(0, vocab, size=int(rng.integers(*response))).tolist()
        sequences.append((prompt_ids, response_ids))
        rows = [rng.choice(vocab, size=k, replace=False) for _ in response_ids]
        topk.append(np.stack(rows).astype(np.int64) if rows else np.zeros((0, k), dtype=np.int64))
    return sequences, topk


def synthetic_teacher_columns(vocab: int, *, rows: int, k: int, seed: int, prompt=(20, 60), response=(20, 100)) -> dict:
    """Teacher-shard columns with valid log-probabilities, as the trainer reads them."""
    rng = np.random.default_rng(seed)
    names = (
        "sample_id",
        "prompt_ids",
        "response_ids",
        "topk_ids",
        "teacher_topk_logprobs",
        "teacher_sampled_logprobs",
        "sampled_logprobs",
        "advantage",
        "sample_mask",
        "route",
        "pass_rate",
        "teacher_entropy",
    )
    cols: dict[str, list] = {name: [] for name in names}
    for i in range(rows):
        p, t = int(rng.integers(*prompt)), int(rng.integers(*response))
        response_ids = rng.integers(0, vocab, size=t)
        logits = rng.normal(size=(t, vocab)) * 2
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        top = np.argsort(-logp, axis=-1)[:, :k]
        cols["sample_id"].append(i)
        cols["prompt_ids"].append(rng.integers(0, vocab, size=p).tolist())
        cols["response_ids"].append(response_ids.tolist())
        cols["topk_ids"].append(top.astype(np.int32))
        cols["teacher_topk_logprobs"].append(np.take_along_axis(logp, top, -1).astype(np.float32))
        cols["teacher_sampled_logprobs"].append(logp[np.arange(t), response_ids].astype(np.float32))
        cols["sampled_logprobs"].append((logp[np.arange(t), response_ids] - 0.1).astype(np.float32))
        cols["advantage"].append(float(rng.normal()))
        cols["sample_mask"].append(bool(i % 3))
        cols["route"].append(None)
        cols["pass_rate"].append((i % 5) / 4)  # no draw from rng: the stream stays as it was
        cols["teacher_entropy"].append(-(np.exp(logp) * logp).sum(-1).astype(np.float32))
    return cols


def write_training_inputs(root: Path) -> tuple[Path, Path, dict]:
    """A tiny from-scratch HF model in root/hf and 16 teacher-shard rows pickled to root/columns.pkl.

    What the trainer tests feed to `tests/integration/_scripts/*_worker.py`: (hf dir, columns path,
    columns).
    """
    import pickle

    from tasks.data.bootstrap_model import build_model, build_tokenizer

    hf = root / "hf"
    tokenizer = build_tokenizer(hf)
    model = build_model(tokenizer, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, max_positions=64, seed=1)
    model.save_pretrained(hf)
    columns = synthetic_teacher_columns(len(tokenizer), rows=16, k=6, seed=0, prompt=(3, 7), response=(1, 5))
    path = root / "columns.pkl"
    path.write_bytes(pickle.dumps(columns))
    return hf, path, columns


RESPONSES = (
    "<think>7 plus 5 is 12</think>The answer is 12.",
    "Let me write code:\n```python\nprint(7 + 5)\n```\nSo 12.",
    '<tool_call>{"name": "add", "arguments": {"a": 7, "b": 5}}</tool_call>',
    "It is 13.",
)


def write_synthetic_run(
    root: str,
    name: str,
    *,
    local_dir: Path,
    rows: int,
    group_size: int,
    seed: int,
    iteration: int = 1,
    top_k: int = 8,
    scored: bool = True,
    texts: tuple[str, ...] | None = RESPONSES,
    rows_per_shard: int = 4096,
    row_group_size: int = 256,
    response_len: tuple[int, int] = (16, 64),
    overrides: tuple[str, ...] = (),
):
    """A run with no model behind it under `root` (a path or URL): run.json (default config and
    `overrides`), the
    demo tokenizer as the policy checkpoint of iteration `iteration - 1`, and a committed rollout
    (and, with `scored`, teacher) stage of `rows` synthetic samples in groups of `group_size`, made
    as the teacher stage makes them (masks, teacher prompts, routes and pass rates from the run's
    feedback policy and loss).
    `local_dir` holds the tokenizer files and the checkpoint cache. Returns the run's RunLayout.

    With `texts`, responses cycle through them, tokenised with that tokenizer (the sampled token is
    one of its top-K candidates); without, they are `storage.synthetic` rows (random ids, words).
    """
    from storage.checkpoints import upload_checkpoint
    from storage.layout import RunLayout, create_or_open_run
    from storage.schemas import ROLLOUT, TEACHER
    from storage.shard_columns import Ragged
    from storage.shard_writer import write_shards
    from storage.synthetic import synthetic_columns, synthetic_topk
    from tasks.config import load_config, to_dict
    from tasks.data.bootstrap_model import build_tokenizer

    cfg = load_config(
        None, [f"name={name}", f"storage.root={root}", f"storage.cache_dir={local_dir / 'cache'}", *overrides]
    )
    layout = RunLayout(root, name)
    create_or_open_run(layout, to_dict(cfg))
    tokenizer = build_tokenizer(local_dir / "tokenizer")
    upload_checkpoint(local_dir / "tokenizer", layout, iteration - 1, "policy", parent="synthetic tokenizer")
    rng = np.random.default_rng(seed)
    columns = synthetic_columns(
        iteration=iteration,
        n_rows=rows,
        top_k=top_k,
        rng=rng,
        vocab=len(tokenizer),
        group_size=group_size,
        teacher=True,
        response_len=response_len,
    )
    prompts = [
        tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        for m in columns["prompt_messages"]
    ]
    columns["prompt_ids"] = [np.asarray(p, dtype=np.int32) for p in prompts]
    if texts is not None:
        chosen = [texts[i % len(texts)] for i in range(rows)]
        response_ids = [np.asarray(tokenizer.encode(t, add_special_tokens=False), dtype=np.int32) for t in chosen]
        lengths = np.array([len(r) for r in response_ids])
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        ids, logprobs = synthetic_topk(int(offsets[-1]), top_k, vocab=len(tokenizer), rng=rng)
        flat = np.concatenate(response_ids)
        cumulative = np.cumsum(np.exp(logprobs.astype(np.float64)), axis=1)
        pick = (cumulative < rng.random(flat.size)[:, None] * cumulative[:, -1:]).sum(axis=1)  # likely positions
        rows_ = np.arange(flat.size)
        clash = (ids == flat[:, None]) & (np.arange(top_k)[None, :] != pick[:, None])
        ids[clash] = ids[rows_, pick][clash.any(axis=1)]  # keep the K ids distinct
        ids[rows_, pick] = flat
        noise = rng.normal(0.0, 1.0, logprobs.shape).astype(np.float32)
        teacher = np.minimum(logprobs + noise, 0.0)
        columns |= {
            "response_ids": Ragged(flat, offsets),
            "response_text": chosen,
            "finish_reason": ["length" if i % 5 == 4 else "stop" for i in range(rows)],
            "data_source": ["synthetic_code" if (i // group_size) % 2 else "synthetic_math" for i in range(rows)],
            "topk_ids": Ragged(ids, offsets),
            "topk_logprobs": Ragged(logprobs, offsets),
            "sampled_logprobs": Ragged(logprobs[rows_, pick], offsets),
            "teacher_topk_logprobs": Ragged(teacher, offsets),
            "teacher_sampled_logprobs": Ragged(teacher[rows_, pick], offsets),
            "teacher_entropy": Ragged(-(np.exp(teacher) * teacher).sum(axis=1).astype(np.float32), offsets),
        }
    # The teacher columns the teacher stage would write: contexts from the run's feedback policy.
    from sdpo_core.routing import pass_rates
    from tasks.teacher import feedback_policy, routes, sample_records, success_threshold

    records = sample_records(columns)
    policy = feedback_policy(cfg)
    groups: dict[int, list] = {}
    for record in records:
        groups.setdefault(record.group_id, []).append(record)
    contexts = {c.sample_id: c for members in groups.values() for c in policy.prepare_group(members)}
    ordered = [contexts[r.sample_id] for r in records]
    teacher_ids = [
        tokenizer.apply_chat_template(list(c.messages), add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
        for c in ordered
    ]
    columns |= {
        "teacher_prompt_ids": [np.asarray(t, dtype=np.int32) for t in teacher_ids],
        "teacher_prompt_text": [tokenizer.decode(t, skip_special_tokens=False) for t in teacher_ids],
        "teacher_source": [c.source for c in ordered],
        "sample_mask": [c.mask for c in ordered],
        "route": routes(cfg, records, ordered),
        "pass_rate": np.asarray(
            pass_rates(
                [r.reward for r in records], [r.group_id for r in records], success_threshold=success_threshold(policy)
            ),
            dtype=np.float32,
        ),
    }
    sizes = {"rows_per_shard": rows_per_shard, "row_group_size": row_group_size}
    rollout = write_shards(layout, iteration, "rollout", {c: columns[c] for c in ROLLOUT.names}, **sizes).commit()
    if scored:
        teacher = {c: columns[c] for c in TEACHER.names}
        write_shards(layout, iteration, "teacher", teacher, **sizes).commit(parents=[rollout])
    return layout
