import math

import pytest
import torch

from sdpo_core.divergence import sampled_token_loss, topk_divergence
from sdpo_core.grpo import ppo_clip_loss
from sdpo_core.losses import LossInputs, importance_weights, policy_loss
from sdpo_core.reductions import loss_denominator, masked_mean

# Hand example: 3 samples, T=4; sample 1 has no teacher.
PER_TOKEN = [[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, 100.0, 100.0], [6.0, 100.0, 100.0, 100.0]]
RESPONSE = [[True, True, True, False], [True, True, False, False], [True, False, False, False]]
SAMPLES = [True, False, True]


@pytest.fixture
def hand_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.tensor(PER_TOKEN), torch.tensor(RESPONSE), torch.tensor(SAMPLES)


@pytest.mark.parametrize(
    ("reduction", "aggregation", "expected"),
    [
        ("exclude", "token-mean", (1 + 2 + 3 + 6) / 4),  # active tokens only
        ("dilute", "token-mean", (1 + 2 + 3 + 6) / 6),  # all 6 response tokens in the count
        ("exclude", "sequence-mean", (2 + 6) / 2),  # mean of the two active samples' means
        ("dilute", "sequence-mean", (2 + 0 + 6) / 3),  # the masked sample counts as 0
    ],
)
def test_masked_mean_hand_example(hand_batch, reduction, aggregation, expected):
    per_token, response, samples = hand_batch
    got = masked_mean(per_token, response, samples, reduction=reduction, aggregation=aggregation)
    assert got.item() == pytest.approx(expected)


@pytest.mark.parametrize("reduction", ["exclude", "dilute"])
@pytest.mark.parametrize("aggregation", ["token-mean", "sequence-mean"])
def test_all_masked_gives_zero_loss_and_zero_gradient(reduction, aggregation):
    per_token = torch.tensor([[math.inf, 1.0], [math.nan, 2.0]], requires_grad=True)
    response = torch.tensor([[True, True], [True, False]])
    samples = torch.tensor([False, False])
    loss = masked_mean(per_token, response, samples, reduction=reduction, aggregation=aggregation)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(per_token.grad, torch.zeros_like(per_token))


@pytest.mark.parametrize("reduction", ["exclude", "dilute"])
@pytest.mark.parametrize("aggregation", ["token-mean", "sequence-mean"])
def test_whole_batch_denominator_makes_micro_batches_sum_to_the_batch_mean(hand_batch, reduction, aggregation):
    per_token, response, samples = hand_batch
    full = masked_mean(per_token, response, samples, reduction=reduction, aggregation=aggregation)
    denominator = loss_denominator(response, samples, reduction=reduction, aggregation=aggregation)
    parts = sum(
        masked_mean(
            per_token[i : i + 1],
            response[i : i + 1],
            samples[i : i + 1],
            reduction=reduction,
            aggregation=aggregation,
            denominator=denominator,
        )
        for i in range(3)
    )
    torch.testing.assert_close(parts, full)


def test_masked_mean_gradient_touches_only_active_tokens(hand_batch):
    per_token, response, samples = hand_batch
    per_token = per_token.clone().requires_grad_(True)
    masked_mean(per_token, response, samples, reduction="exclude", aggregation="token-mean").backward()
    expected = (response & samples[:, None]).float() / 4
    assert torch.equal(per_token.grad, expected)


def test_masked_mean_rejects_bad_modes_and_shapes(hand_batch):
    per_token, response, samples = hand_batch
    with pytest.raises(ValueError, match="'mean'"):
        masked_mean(per_token, response, samples, reduction="mean", aggregation="token-mean")
    with pytest.raises(ValueError, match=r"\(2,\)"):
        masked_mean(per_token, response, samples[:2], reduction="exclude", aggregation="token-mean")
    with pytest.raises(TypeError, match="bool"):
        masked_mean(per_token, response.float(), samples, reduction="exclude", aggregation="token-mean")


def test_importance_weights_are_clipped_and_detached():
    logprobs = torch.tensor([[-1.0, -1.0, -1.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0 - math.log(1.5), -1.0 - math.log(3.0), -100.0]])
    weights = importance_weights(logprobs, old, clip=2.0)
    torch.testing.assert_close(weights, torch.tensor([[1.0, 1.5, 2.0, 2.0]]))
    assert not weights.requires_grad
    assert torch.equal(importance_weights(logprobs, old, clip=None), torch.ones(1, 4))
    with pytest.raises(ValueError, match="-1"):
        importance_weights(logprobs, old, clip=-1.0)


def test_importance_weights_log_ratio_is_clamped():
    weights = importance_weights(torch.tensor([[0.0]]), torch.tensor([[100.0]]), clip=2.0)
    torch.testing.assert_close(weights, torch.tensor([[math.exp(-20.0)]]))


def _inputs(*, sample_mask: list[bool] | None = None, seed: int = 0) -> LossInputs:
    gen = torch.Generator().manual_seed(seed)
    batch, length, vocab, k = 3, 4, 10, 4
    student_logits = torch.randn(batch, length, vocab, generator=gen, requires_grad=True)
    teacher_logits = torch.randn(batch, length, vocab, generator=gen)
    student_lp = torch.log_softmax(student_logits, -1)
    teacher_lp = torch.log_softmax(teacher_logits, -1)
    ids = student_logits.detach().topk(k, dim=-1).indices
    sampled = torch.randint(0, vocab, (batch, length, 1), generator=gen)
    student_token = student_lp.gather(-1, sampled).squeeze(-1)
    return LossInputs(
        student_token_logprobs=student_token,
        old_token_logprobs=student_token.detach() + 0.3 * torch.randn(batch, length, generator=gen),
        response_mask=torch.tensor([[True, True, True, True], [True, True, False, False], [True, True, True, False]]),
        sample_mask=torch.tensor(sample_mask or [True, False, True]),
        student_topk_logprobs=student_lp.gather(-1, ids),
        teacher_topk_logprobs=teacher_lp.gather(-1, ids),
        teacher_token_logprobs=teacher_lp.gather(-1, sampled).squeeze(-1),
        advantages=torch.tensor([0.5, -1.0, 0.25]),
        student_logits=student_logits,
        teacher_logits=teacher_logits,
    )


LOSS_KWARGS = dict(
    divergence="topk_tail",
    alpha=0.5,
    is_clip=2.0,
    reduction="dilute",
    aggregation="token-mean",
    clip_low=0.2,
    clip_high=0.28,
    srpo_beta=1.0,
    pass_rate_weight=False,
)


def test_sdpo_loss_is_weighted_masked_divergence():
    inputs = _inputs()
    out = policy_loss(inputs, loss_type="sdpo", blend_lambda=0.0, **LOSS_KWARGS)
    divergence = topk_divergence(inputs.student_topk_logprobs, inputs.teacher_topk_logprobs, alpha=0.5, tail=True)
    weights = importance_weights(inputs.student_token_logprobs, inputs.old_token_logprobs, clip=2.0)
    expected = masked_mean(
        divergence * weights, inputs.response_mask, inputs.sample_mask, reduction="dilute", aggregation="token-mean"
    )
    torch.testing.assert_close(out.loss, expected)
    assert out.metrics["loss/total"] == pytest.approx(expected.item())
    assert out.metrics["sdpo/active_token_fraction"] == pytest.approx(7 / 9)
    assert out.metrics["sdpo/active_sample_fraction"] == pytest.approx(2 / 3)
    assert 0.0 < out.metrics["sdpo/is_weight_mean"] <= 2.0
    assert 0.0 < out.metrics["sdpo/student_topk_mass_mean"] < 1.0
    assert all(isinstance(v, float) for v in out.metrics.values())
    assert not any(key.startswith("grpo/") for key in out.metrics)


def test_sdpo_loss_gradient_reaches_only_the_student():
    inputs = _inputs()
    teacher = inputs.teacher_topk_logprobs.clone().requires_grad_(True)
    inputs = LossInputs(**{**inputs.__dict__, "teacher_topk_logprobs": teacher})
    out = policy_loss(inputs, loss_type="sdpo", blend_lambda=0.0, **LOSS_KWARGS)
    out.loss.backward()
    assert teacher.grad is None
    assert inputs.student_logits.grad is not None and inputs.student_logits.grad.abs().sum() > 0


@pytest.mark.parametrize("divergence", ["topk_tail", "topk_renorm", "full", "sampled_token"])
def test_all_masked_sdpo_loss_is_zero_with_zero_gradient(divergence):
    inputs = _inputs(sample_mask=[False, False, False])
    kwargs = {**LOSS_KWARGS, "divergence": divergence, "alpha": 1.0, "reduction": "exclude"}
    out = policy_loss(inputs, loss_type="sdpo", blend_lambda=0.0, **kwargs)
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert torch.equal(inputs.student_logits.grad, torch.zeros_like(inputs.student_logits))
    assert all(math.isfinite(v) for v in out.metrics.values())
    assert out.metrics["sdpo/active_token_fraction"] == 0.0


def test_sampled_token_policy_loss_matches_its_surrogate():
    inputs = _inputs()
    kwargs = {**LOSS_KWARGS, "divergence": "sampled_token", "alpha": 1.0, "is_clip": None}
    out = policy_loss(inputs, loss_type="sdpo", blend_lambda=0.0, **kwargs)
    surrogate = sampled_token_loss(inputs.student_token_logprobs, inputs.teacher_token_logprobs)
    expected = masked_mean(
        surrogate, inputs.response_mask, inputs.sample_mask, reduction="dilute", aggregation="token-mean"
    )
    torch.testing.assert_close(out.loss, expected)
    assert out.metrics["sdpo/is_weight_mean"] == 1.0


def test_sampled_token_rejects_alpha_other_than_one():
    with pytest.raises(ValueError, match="alpha=0.5"):
        policy_loss(_inputs(), loss_type="sdpo", blend_lambda=0.0, **{**LOSS_KWARGS, "divergence": "sampled_token"})


def test_full_divergence_uses_logits():
    inputs = _inputs()
    out = policy_loss(inputs, loss_type="sdpo", blend_lambda=0.0, **{**LOSS_KWARGS, "divergence": "full"})
    assert torch.isfinite(out.loss) and out.loss.item() > 0


def test_grpo_loss_ignores_sample_mask():
    inputs = _inputs()
    out = policy_loss(inputs, loss_type="grpo", blend_lambda=1.0, **LOSS_KWARGS)
    per_token = ppo_clip_loss(
        inputs.student_token_logprobs,
        inputs.old_token_logprobs,
        inputs.advantages,
        inputs.response_mask,
        clip_low=0.2,
        clip_high=0.28,
    )
    expected = per_token.sum() / inputs.response_mask.sum()
    torch.testing.assert_close(out.loss, expected)
    assert {"grpo/clip_fraction", "grpo/ratio_mean", "grpo/loss", "loss/total"} <= out.metrics.keys()
    assert not any(key.startswith("sdpo/") for key in out.metrics)


def test_blend_endpoints_equal_the_pure_losses():
    inputs = _inputs()
    sdpo = policy_loss(inputs, loss_type="sdpo", blend_lambda=0.0, **LOSS_KWARGS).loss
    grpo = policy_loss(inputs, loss_type="grpo", blend_lambda=1.0, **LOSS_KWARGS).loss
    torch.testing.assert_close(policy_loss(inputs, loss_type="blend", blend_lambda=0.0, **LOSS_KWARGS).loss, sdpo)
    torch.testing.assert_close(policy_loss(inputs, loss_type="blend", blend_lambda=1.0, **LOSS_KWARGS).loss, grpo)
    mixed = policy_loss(inputs, loss_type="blend", blend_lambda=0.3, **LOSS_KWARGS)
    torch.testing.assert_close(mixed.loss, 0.3 * grpo + 0.7 * sdpo)
    assert {"sdpo/divergence_mean", "grpo/clip_fraction"} <= mixed.metrics.keys()


def test_missing_inputs_are_named():
    inputs = _inputs()
    bare = LossInputs(
        student_token_logprobs=inputs.student_token_logprobs,
        old_token_logprobs=inputs.old_token_logprobs,
        response_mask=inputs.response_mask,
        sample_mask=inputs.sample_mask,
    )
    with pytest.raises(ValueError, match="student_topk_logprobs"):
        policy_loss(bare, loss_type="sdpo", blend_lambda=0.0, **LOSS_KWARGS)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(bare, loss_type="grpo", blend_lambda=1.0, **LOSS_KWARGS)


def test_loss_inputs_reject_inconsistent_shapes():
    inputs = _inputs()
    with pytest.raises(ValueError, match="advantages"):
        LossInputs(**{**inputs.__dict__, "advantages": torch.zeros(2)})
    with pytest.raises(ValueError, match="teacher_topk_logprobs"):
        LossInputs(**{**inputs.__dict__, "teacher_topk_logprobs": inputs.teacher_topk_logprobs[..., :2]})
    with pytest.raises(TypeError, match="bool"):
        LossInputs(**{**inputs.__dict__, "sample_mask": torch.ones(3)})


def test_policy_loss_rejects_unknown_modes():
    with pytest.raises(ValueError, match="'ppo'"):
        policy_loss(_inputs(), loss_type="ppo", blend_lambda=0.0, **LOSS_KWARGS)
    with pytest.raises(ValueError, match="1.5"):
        policy_loss(_inputs(), loss_type="blend", blend_lambda=1.5, **LOSS_KWARGS)


def test_combined_metrics_are_the_means_over_the_whole_step():
    """Counted metrics: the mean over every element of all micro-batches (an empty micro-batch adds
    nothing); uncounted ones (loss shares): the sum."""
    from sdpo_core.metrics import combine_metrics

    parts = [
        ({"sdpo/divergence_mean": 0.5, "sdpo/loss": 0.1}, {"sdpo/divergence_mean": 3.0}),
        ({"sdpo/divergence_mean": 0.0, "sdpo/loss": 0.0}, {"sdpo/divergence_mean": 0.0}),
        ({"sdpo/divergence_mean": 2.0, "sdpo/loss": 0.4}, {"sdpo/divergence_mean": 1.0}),
    ]
    out = combine_metrics(parts)
    assert out["sdpo/divergence_mean"] == pytest.approx((0.5 * 3 + 2.0 * 1) / 4)
    assert out["sdpo/loss"] == pytest.approx(0.5)
    assert combine_metrics([({"m": 0.0}, {"m": 0.0})]) == {"m": 0.0}
    with pytest.raises(ValueError, match="different metrics"):
        combine_metrics([({"a": 1.0}, {}), ({"b": 1.0}, {})])


def test_policy_loss_counts_what_each_metric_averages():
    import torch

    from sdpo_core.losses import LossInputs, policy_loss

    b, t, k = 3, 4, 2
    response_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    sample_mask = torch.tensor([True, False, True])
    logp = torch.full((b, t), -1.0)
    topk = torch.log_softmax(torch.zeros(b, t, k + 1), dim=-1)[..., :k]
    out = policy_loss(
        LossInputs(
            student_topk_logprobs=topk,
            teacher_topk_logprobs=topk,
            student_token_logprobs=logp,
            old_token_logprobs=logp,
            teacher_token_logprobs=logp,
            advantages=torch.ones(b),
            response_mask=response_mask,
            sample_mask=sample_mask,
        ),
        loss_type="blend",
        divergence="topk_tail",
        alpha=0.5,
        blend_lambda=0.5,
        is_clip=2.0,
        reduction="dilute",
        aggregation="token-mean",
        clip_low=0.2,
        clip_high=0.2,
        srpo_beta=1.0,
        pass_rate_weight=False,
    )
    counts = out.metric_counts
    assert counts["sdpo/divergence_mean"] == 7.0  # active tokens: samples 0 and 2
    assert counts["sdpo/active_token_fraction"] == 9.0 and counts["sdpo/active_sample_fraction"] == 3.0
    assert counts["grpo/clip_fraction"] == 9.0
    assert not {"sdpo/loss", "grpo/loss", "loss/total"} & set(counts)
