"""The embedded engine's captured decode on CUDA (tasks/engines/graph_decode.py): the bounded decode
attention kernel against its torch definition, and captured sampling against the eager loop and a
full forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize(("rows", "groups", "per_group", "dim"), [(3, 2, 2, 64), (64, 8, 2, 128), (5, 3, 3, 64)])
def test_the_decode_attention_kernel_equals_its_torch_definition(rows, groups, per_group, dim):
    from tasks.engines.decode_attention import decode_attention, reference_decode_attention

    torch.manual_seed(0)
    capacity = 300  # several kernel blocks and, at few rows, several chunks per row
    q = torch.randn(rows, groups * per_group, 1, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(rows, groups, capacity, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    k[:, :, 290:] = float("nan")  # never-written columns must not leak in
    v[:, :, 290:] = float("nan")
    start = torch.randint(0, 100, (rows,), device="cuda")
    for end in (101, 160, 290):
        end_t = torch.tensor([end], device="cuda")
        got = decode_attention(q, k, v, start, end_t, dim**-0.5)
        want = reference_decode_attention(q, k, v, start, end_t, dim**-0.5)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def _engines(folder, dtype, max_batch_size):
    from tasks.engines.embedded import EmbeddedEngine

    return (
        EmbeddedEngine(str(folder), device="cuda", dtype=dtype, max_batch_size=max_batch_size, decode=loop)
        for loop in ("static", "eager")
    )


def _sample(engine, prompts, **overrides):
    kwargs = dict(n=4, temperature=1.0, top_p=1.0, max_new_tokens=48, stop_token_ids=[], top_k_logprobs=8, seed=3)
    return engine.generate(prompts, **{**kwargs, **overrides})


@pytest.fixture(scope="module")
def peaked_dir(tiny_hf_dir, tmp_path_factory):
    """The tiny model with its head scaled: a random model is nearly uniform over 1024 ids, where
    float round-off between two correct kernels flips an inverse-CDF draw now and then."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("peaked")
    model = AutoModelForCausalLM.from_pretrained(tiny_hf_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 1024, size=int(n)).tolist() for n in rng.integers(5, 40, size=12)]


def test_captured_sampling_equals_the_eager_loop_in_float32(peaked_dir, prompts):
    """Float32, so round-off cannot flip a draw: the same tokens, log-probs within 1e-4, and with a
    stop id the rows leave in buckets and every sample is still the eager loop's."""
    captured, eager = _engines(peaked_dir, torch.float32, 64)
    probe = _sample(eager, prompts)
    firsts = [t for group in probe for g in group for t in g.response_ids[:12]]
    stop = max(set(firsts), key=firsts.count)
    for stops in ([], [stop]):
        a, b = _sample(captured, prompts, stop_token_ids=stops), _sample(eager, prompts, stop_token_ids=stops)
        assert [[g.response_ids for g in group] for group in a] == [[g.response_ids for g in group] for group in b]
        for x, y in zip((g for group in a for g in group), (g for group in b for g in group), strict=True):
            np.testing.assert_allclose(x.sampled_logprobs, y.sampled_logprobs, atol=1e-4)
            np.testing.assert_allclose(x.topk_logprobs, y.topk_logprobs, atol=1e-4)
    lengths = {len(g.response_ids) for group in a for g in group}
    assert min(lengths) < 16 < max(lengths), lengths  # some rows stopped before the first bucket move


def test_captured_bf16_logprobs_equal_a_full_forward(tiny_hf_dir, prompts):
    captured, _ = _engines(tiny_hf_dir, torch.bfloat16, 64)
    out = _sample(captured, prompts, seed=5)
    model = captured.model
    for prompt, group in zip(prompts, out, strict=True):
        for gen in group:
            with torch.no_grad():
                ids = torch.tensor([prompt + gen.response_ids], device="cuda")
                logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            full = torch.log_softmax(logits, dim=-1).cpu()
            picked = full.gather(-1, torch.tensor(gen.response_ids)[:, None])[:, 0].numpy()
            np.testing.assert_allclose(gen.sampled_logprobs, picked, atol=0.05)


def test_captured_samples_repeat_and_do_not_depend_on_the_batch(peaked_dir, prompts):
    big, _ = _engines(peaked_dir, torch.float32, 64)
    small, _ = _engines(peaked_dir, torch.float32, 3)
    first, again, split = _sample(big, prompts), _sample(big, prompts), _sample(small, prompts)
    ids = lambda out: [[g.response_ids for g in group] for group in out]  # noqa: E731
    assert ids(first) == ids(again)  # bit for bit: the same graphs on the same inputs
    assert ids(first) == ids(split)
