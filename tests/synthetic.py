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
    names = ("sample_id", "prompt_ids", "response_ids", "topk_ids", "teacher_topk_logprobs",
             "teacher_sampled_logprobs", "sampled_logprobs", "advantage", "sample_mask")
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
    return cols


def write_training_inputs(root: Path) -> tuple[Path, Path, dict]:
    """A tiny from-scratch HF model in root/hf and 16 teacher-shard rows pickled to root/columns.pkl.

    What the trainer tests feed to `tests/integration/_scripts/*_worker.py`: (hf dir, columns path,
    columns).
    """
    import pickle

    from tasks.bootstrap import build_model, build_tokenizer

    hf = root / "hf"
    tokenizer = build_tokenizer(hf)
    model = build_model(tokenizer, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, max_positions=64, seed=1)
    model.save_pretrained(hf)
    columns = synthetic_teacher_columns(len(tokenizer), rows=16, k=6, seed=0, prompt=(3, 7), response=(1, 5))
    path = root / "columns.pkl"
    path.write_bytes(pickle.dumps(columns))
    return hf, path, columns
