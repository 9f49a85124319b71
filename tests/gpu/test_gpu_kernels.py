"""The GPU kernels of the draw, the RMSNorm and the teacher's scoring, each against its torch definition."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize(("dtype", "temperature"), [(torch.bfloat16, 1.0), (torch.float32, 0.7), (torch.bfloat16, 1.3)])
def test_the_fused_draw_inverts_the_cdf_within_float32_round_off(dtype, temperature):
    """Each id drawn holds the target u * total of the float64 CDF within 1e-5 of the total: the
    float32 sums of 151,936 terms, in the kernel's order or in torch's cumsum, move a target that
    close to a boundary to the neighbouring id (for about 1-2 % of rows of these logits, either way)."""
    from tasks.engines.draw_kernel import fused_draw
    from tasks.engines.sampling import draw

    torch.manual_seed(0)
    rows, vocab = 512, 151_936
    logits = (torch.randn(rows, vocab, device="cuda") * 3).to(dtype)
    u = torch.rand(rows, device="cuda")
    ids, lse = fused_draw(logits, u, temperature=temperature)
    scaled = logits.double() / temperature
    cdf = torch.exp(scaled - scaled.max(dim=-1, keepdim=True).values).cumsum(dim=-1)  # [B, V] float64
    total = cdf[:, -1]
    target = u.double() * total
    upper = cdf.gather(1, ids[:, None])[:, 0]
    lower = torch.where(ids > 0, cdf.gather(1, (ids - 1).clamp(min=0)[:, None])[:, 0], torch.zeros_like(upper))
    slack = 1e-5 * total
    assert bool(((lower - slack <= target) & (target <= upper + slack)).all())
    # the torch draw is held to the same float64 CDF, and agrees with the kernel on almost every row
    agree = (ids == draw(logits.float() / temperature, top_p=1.0, u=u)).float().mean().item()
    assert agree >= 0.95, agree
    torch.testing.assert_close(lse, torch.logsumexp(logits.float(), dim=-1), rtol=0, atol=1e-4)
    greedy_ids, greedy_lse = fused_draw(logits, None, temperature=1.0)
    assert greedy_ids is None and torch.equal(greedy_lse, lse)


def test_the_fused_draw_never_picks_an_id_without_mass():
    from tasks.engines.draw_kernel import fused_draw

    logits = torch.full((4, 5000), float("-inf"), device="cuda")
    logits[:, 1234] = 0.0  # one id holds all the mass
    ids, _ = fused_draw(logits, torch.tensor([0.0, 0.5, 0.999999, 0.9999999], device="cuda"), temperature=1.0)
    assert ids.tolist() == [1234] * 4


@pytest.mark.parametrize("shape", [(512, 1, 1024), (512, 1, 16, 128), (7, 3, 2048)])
def test_the_fused_rms_norm_equals_the_hf_module(shape):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from tasks.engines.norm_kernel import use_fused_rms_norms

    torch.manual_seed(0)
    module = Qwen3RMSNorm(shape[-1], eps=1e-6).cuda().to(torch.bfloat16)
    module.weight.data.normal_()
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    strided = torch.randn((*shape[:-1], 2 * shape[-1]), device="cuda", dtype=torch.bfloat16)[..., : shape[-1]]
    want, want_strided = module(x), module(strided)
    assert use_fused_rms_norms(module) == 1
    got = module(x)
    # the same arithmetic; a mean summed in another order can move a product by one bf16 step
    assert (got != want).float().mean().item() < 0.01
    torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-2)
    assert torch.equal(module(strided), want_strided)  # a strided input keeps the module's own forward


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fused_teacher_scores_equal_the_torch_scores(dtype):
    from tasks.megatron.scoring_kernel import fused_token_scores, reference_token_scores

    torch.manual_seed(0)
    vocab, padded, k = 151_936, 152_064, 101
    logits = (torch.randn(700, padded, device="cuda") * 4).to(dtype)
    logits[:, vocab:] = 50.0  # Megatron's padding columns must not count
    rows = torch.randperm(700, device="cuda")[:600]
    ids = torch.randint(0, vocab, (600, k), device="cuda")
    got_lp, got_entropy = fused_token_scores(logits, rows, ids, vocab_size=vocab)
    want_lp, want_entropy = reference_token_scores(logits, rows, ids, vocab_size=vocab)
    torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=2e-4)
    torch.testing.assert_close(got_entropy, want_entropy, rtol=0, atol=2e-4)
