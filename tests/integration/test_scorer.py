import numpy as np
import pytest
import torch

from tasks.data.bootstrap_model import build_model, build_tokenizer, prompt_ids
from tasks.engines.embedded import EmbeddedEngine
from tasks.engines.scorer import pack_batches, score_teacher

K = 4


def tiny_model(tokenizer, *, seed):
    model = build_model(
        tokenizer, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, max_positions=128, seed=seed
    )
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_model(tokenizer, seed=0)


@pytest.fixture(scope="module")
def cases(tokenizer):
    """Teacher-like prompts of different lengths with made-up responses and top-K ids."""
    rng = np.random.default_rng(0)
    vocab = len(tokenizer)
    texts = ["1+2=", "40+41=\nCorrect solution:\n\n81\n\nCorrectly solve the original question.", "9+9=", "77+1="]
    sequences, topk = [], []
    for i, text in enumerate(texts):
        prompt = prompt_ids(tokenizer, [{"role": "user", "content": text}])
        response = rng.integers(0, vocab, size=3 + 2 * i).tolist()
        sequences.append((prompt, response))
        topk.append(rng.integers(0, vocab, size=(len(response), K)).astype(np.int32))
    return sequences, topk


def reference_logprobs(model, prompt, response):
    """Full-vocabulary log_softmax of one unpadded forward, at the response positions: [T, V]."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(response)], dim=-1)


def test_scores_match_a_full_forward(model, cases):
    sequences, topk = cases
    scored = score_teacher(model, sequences=sequences, topk_ids=topk, batch_tokens=10_000)
    assert len(scored) == len(sequences)
    for (prompt, response), ids, (topk_lp, sampled_lp, entropy) in zip(sequences, topk, scored, strict=True):
        full = reference_logprobs(model, prompt, response)
        assert topk_lp.shape == (len(response), K) and topk_lp.dtype == np.float32
        assert sampled_lp.shape == (len(response),) and sampled_lp.dtype == np.float32
        # the teacher's entropy over the whole vocabulary, not over the top-K ids
        assert entropy.shape == (len(response),) and entropy.dtype == np.float32
        full64 = full.double()
        np.testing.assert_allclose(entropy, -(full64.exp() * full64).sum(-1).numpy(), atol=1e-5)
        np.testing.assert_allclose(topk_lp, full.gather(-1, torch.as_tensor(ids, dtype=torch.long)).numpy(), atol=1e-5)
        np.testing.assert_allclose(
            sampled_lp, full.gather(-1, torch.tensor(response)[:, None])[:, 0].numpy(), atol=1e-5
        )


@pytest.mark.parametrize("batch_tokens, chunk", [(1, 1), (60, 3), (150, 2), (100_000, 1024)])
def test_batching_and_chunking_do_not_change_the_result(model, cases, batch_tokens, chunk):
    sequences, topk = cases
    expected = score_teacher(model, sequences=sequences, topk_ids=topk, batch_tokens=100_000)
    got = score_teacher(model, sequences=sequences, topk_ids=topk, batch_tokens=batch_tokens, logit_chunk_tokens=chunk)
    for a, b in zip(expected, got, strict=True):
        np.testing.assert_allclose(a.topk_logprobs, b.topk_logprobs, atol=1e-5)
        np.testing.assert_allclose(a.sampled_logprobs, b.sampled_logprobs, atol=1e-5)
        np.testing.assert_allclose(a.entropy, b.entropy, atol=1e-5)


def test_student_scores_match_the_engine(tmp_path, tokenizer, model):
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = EmbeddedEngine(str(tmp_path), max_batch_size=8)
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": c}]) for c in ["5+5=", "123+4=", "0+0="]]
    out = engine.generate(
        prompts,
        n=3,
        temperature=1.0,
        top_p=1.0,
        max_new_tokens=6,
        stop_token_ids=[tokenizer.eos_token_id],
        top_k_logprobs=K,
        seed=0,
    )
    gens = [(p, g) for p, group in zip(prompts, out, strict=True) for g in group]
    scored = score_teacher(
        model, sequences=[(p, g.response_ids) for p, g in gens], topk_ids=[g.topk_ids for _, g in gens], batch_tokens=64
    )
    for (_, gen), (topk_lp, sampled_lp, _) in zip(gens, scored, strict=True):
        np.testing.assert_allclose(topk_lp, gen.topk_logprobs, atol=1e-5)
        np.testing.assert_allclose(sampled_lp, gen.sampled_logprobs, atol=1e-5)


def test_trust_region_mixes_logits_of_reference_and_model(tokenizer, model, cases):
    sequences, topk = cases
    reference = tiny_model(tokenizer, seed=1)
    tau = 0.25
    scored = score_teacher(
        model, sequences=sequences, topk_ids=topk, batch_tokens=50, reference_model=reference, trust_region_rate=tau
    )
    for (prompt, response), ids, (topk_lp, sampled_lp, entropy) in zip(sequences, topk, scored, strict=True):
        with torch.no_grad():
            z = model(input_ids=torch.tensor([prompt + response])).logits[0]
            z_ref = reference(input_ids=torch.tensor([prompt + response])).logits[0]
        mixed = torch.log_softmax((1 - tau) * z_ref + tau * z, dim=-1)[
            len(prompt) - 1 : len(prompt) - 1 + len(response)
        ]
        np.testing.assert_allclose(topk_lp, mixed.gather(-1, torch.as_tensor(ids, dtype=torch.long)).numpy(), atol=1e-5)
        np.testing.assert_allclose(
            sampled_lp, mixed.gather(-1, torch.tensor(response)[:, None])[:, 0].numpy(), atol=1e-5
        )
        np.testing.assert_allclose(entropy, -(mixed.exp() * mixed).sum(-1).numpy(), atol=1e-5)  # the mixed teacher's


def test_trust_region_at_rate_one_is_the_model(tokenizer, model, cases):
    sequences, topk = cases
    plain = score_teacher(model, sequences=sequences, topk_ids=topk, batch_tokens=500)
    mixed = score_teacher(
        model,
        sequences=sequences,
        topk_ids=topk,
        batch_tokens=500,
        reference_model=tiny_model(tokenizer, seed=2),
        trust_region_rate=1.0,
    )
    for a, b in zip(plain, mixed, strict=True):
        np.testing.assert_allclose(a.topk_logprobs, b.topk_logprobs, atol=1e-6)


def test_reference_model_needs_a_rate(model, cases):
    sequences, topk = cases
    with pytest.raises(ValueError, match="go together"):
        score_teacher(model, sequences=sequences, topk_ids=topk, batch_tokens=100, reference_model=model)


def test_top_k_rows_must_match_the_response_length(model, cases):
    sequences, topk = cases
    bad = list(topk)
    bad[1] = bad[1][:-1]
    with pytest.raises(ValueError, match=r"sequence 1: topk_ids has shape"):
        score_teacher(model, sequences=sequences, topk_ids=bad, batch_tokens=100)


def test_out_of_vocabulary_top_k_ids_are_rejected(model, cases):
    sequences, topk = cases
    bad = [ids.copy() for ids in topk]
    bad[0][0, 0] = 10_000
    with pytest.raises(ValueError, match="outside"):
        score_teacher(model, sequences=sequences, topk_ids=bad, batch_tokens=100)


def test_empty_prompt_is_rejected(model):
    with pytest.raises(ValueError, match="prompt is empty"):
        score_teacher(model, sequences=[([], [1, 2])], topk_ids=[np.zeros((2, K), np.int32)], batch_tokens=100)


def test_empty_response_gives_empty_arrays(model):
    (scores,) = score_teacher(model, sequences=[([1, 2], [])], topk_ids=[np.zeros((0, K), np.int32)], batch_tokens=100)
    assert scores.topk_logprobs.shape == (0, K) and scores.sampled_logprobs.shape == (0,)


def test_pack_batches_respects_the_budget_and_covers_every_sequence():
    lengths = [5, 30, 7, 12, 12, 3, 50]
    batches = pack_batches(lengths, batch_tokens=36)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        longest = max(lengths[i] for i in batch)
        assert len(batch) == 1 or len(batch) * longest <= 36
    assert [6] in batches  # longer than the budget: alone
