"""The chunked student log-probs on CUDA (eager and compiled) equal the full log-softmax."""

from __future__ import annotations

import pytest
import torch

from sdpo_core.chunked import chunked_token_logprobs, reference_token_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def value_and_grad(fn, logits, upstream):
    leaf = logits.clone().requires_grad_(True)
    out = fn(leaf)
    (out * upstream).sum().backward()
    return out.detach(), leaf.grad


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("chunk_tokens,chunk_vocab", [(64, None), (100, 1000)])
def test_float32_values_and_gradients_within_1e_5(compile, chunk_tokens, chunk_vocab):
    if compile and chunk_vocab is not None:
        pytest.skip("compiled tiles are meant for whole-vocabulary rows")
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(700, 5003, device="cuda", generator=gen) * 3
    rows = torch.randperm(700, device="cuda", generator=gen)[:450]
    ids = torch.randint(0, 5003, (450, 17), device="cuda", generator=gen)
    ids[:, 0] = 5002
    upstream = torch.randn(450, 17, device="cuda", generator=gen)
    want, want_grad = value_and_grad(
        lambda z: reference_token_logprobs(z.double(), rows, ids), logits, upstream.double()
    )
    got, got_grad = value_and_grad(
        lambda z: chunked_token_logprobs(
            z, rows, ids, chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab, compile=compile
        ),
        logits,
        upstream,
    )
    assert rel(got, want) < 1e-5
    assert rel(got_grad, want_grad) < 1e-5


def test_bfloat16_qwen_vocabulary_with_padding_compiled():
    gen = torch.Generator(device="cuda").manual_seed(1)
    vocab = 151936 - 5  # Megatron pads to the shard size; padded columns must not count
    logits = (torch.randn(1536, 151936, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    rows = torch.arange(0, 1536, 2, device="cuda")
    ids = torch.randint(0, vocab, (768, 101), device="cuda", generator=gen)
    upstream = torch.randn(768, 101, device="cuda", generator=gen)
    want, want_grad = value_and_grad(
        lambda z: reference_token_logprobs(z[:, :vocab].double(), rows, ids), logits, upstream.double()
    )
    got, got_grad = value_and_grad(
        lambda z: chunked_token_logprobs(z, rows, ids, vocab_size=vocab, chunk_tokens=512, compile=True),
        logits,
        upstream,
    )
    assert got_grad.dtype == torch.bfloat16
    assert rel(got, want) < 1e-5  # same bf16 inputs, reduced in float32
    assert rel(got_grad[:, :vocab], want_grad[:, :vocab]) < 1e-2  # gradient rounded to bf16
    assert got_grad[:, vocab:].abs().max() == 0
