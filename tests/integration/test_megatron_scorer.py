"""The Megatron teacher scorer gives the embedded (HF) scorer's log-probs and entropies, also under tensor
parallel 2."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.synthetic import synthetic_scoring_inputs

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tasks.data.bootstrap_model import build_model, build_tokenizer

    root = tmp_path_factory.mktemp("megatron_scorer")
    dirs = {}
    for name, seed in (("teacher", 1), ("reference", 2)):
        dirs[name] = root / name
        tokenizer = build_tokenizer(dirs[name])
        build_model(
            tokenizer, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, max_positions=64, seed=seed
        ).save_pretrained(dirs[name])
    vocab = len(tokenizer)
    sequences, topk = synthetic_scoring_inputs(vocab, count=9, k=5, seed=0, prompt=(1, 8), response=(0, 9))
    inputs = root / "inputs.pkl"
    inputs.write_bytes(pickle.dumps({"sequences": sequences, "topk_ids": topk}))
    return root, dirs, sequences, topk, inputs


def embedded_scores(dirs, sequences, topk, *, rate=None):
    from transformers import AutoModelForCausalLM

    from tasks.engines.scorer import score_teacher

    model = AutoModelForCausalLM.from_pretrained(str(dirs["teacher"]), dtype=torch.float32).eval()
    reference = None
    if rate is not None:
        reference = AutoModelForCausalLM.from_pretrained(str(dirs["reference"]), dtype=torch.float32).eval()
    return score_teacher(
        model, sequences=sequences, topk_ids=topk, batch_tokens=64, reference_model=reference, trust_region_rate=rate
    )


@pytest.mark.parametrize("rate", [None, 0.3])
def test_megatron_scores_equal_the_embedded_scorer(setup, rate):
    from tasks.megatron.scorer import MegatronTeacherScorer

    _, dirs, sequences, topk, _ = setup
    want = embedded_scores(dirs, sequences, topk, rate=rate)
    scorer = MegatronTeacherScorer.from_hf(
        dirs["teacher"], dtype=torch.float32, reference_dir=dirs["reference"] if rate is not None else None
    )
    got = scorer.score(
        sequences=sequences, topk_ids=topk, batch_tokens=40, logit_chunk_tokens=7, trust_region_rate=rate
    )
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.topk_logprobs.shape == w.topk_logprobs.shape and g.topk_logprobs.dtype == np.float32
        np.testing.assert_allclose(g.topk_logprobs, w.topk_logprobs, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(g.sampled_logprobs, w.sampled_logprobs, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(g.entropy, w.entropy, rtol=1e-4, atol=1e-4)


def test_tensor_parallel_scores_equal_the_embedded_scorer(setup):
    root, dirs, sequences, topk, inputs = setup
    out = root / "tp2.pkl"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(REPO / "tests/integration/_scripts/scorer_worker.py"),
        str(dirs["teacher"]),
        str(inputs),
        str(out),
        "2",
        "float32",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    got = pickle.loads(out.read_bytes())
    want = embedded_scores(dirs, sequences, topk)
    for (g_topk, g_tok, g_entropy), w in zip(got, want, strict=True):
        np.testing.assert_allclose(g_topk, w.topk_logprobs, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(g_tok, w.sampled_logprobs, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(g_entropy, w.entropy, rtol=1e-4, atol=1e-4)  # over the whole vocabulary


def test_mismatched_reference_arguments_are_refused(setup):
    from tasks.megatron.scorer import MegatronTeacherScorer

    _, dirs, sequences, topk, _ = setup
    scorer = MegatronTeacherScorer.from_hf(dirs["teacher"], dtype=torch.float32)
    with pytest.raises(ValueError, match="reference"):
        scorer.score(sequences=sequences, topk_ids=topk, batch_tokens=40, trust_region_rate=0.5)
