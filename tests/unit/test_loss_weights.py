"""SRPO's routed loss and the pass-rate weighted SDPO loss against float64 oracles, values and gradients.

The oracles are written token by token from the definitions (the top-K + tail generalised JSD, the
clipped importance weights, the PPO-clip term, the entropy and question weights normalised to mean
1 over the batch's SDPO tokens / samples), independently of `sdpo_core`.
"""

from __future__ import annotations

import math

import pytest
import torch

from sdpo_core.losses import LossInputs, policy_loss
from sdpo_core.reductions import loss_denominator
from sdpo_core.weights import entropy_weights, normalised, question_weights, weight_norm

B, T, V, K = 4, 5, 9, 3
ALPHA, IS_CLIP, CLIP_LOW, CLIP_HIGH = 0.5, 2.0, 0.2, 0.28
LENGTHS = [5, 3, 4, 2]
ROUTE = [True, False, True, False]
SAMPLE_MASK = [True, True, True, False]  # a sample routed to GRPO may still have a teacher
PASS_RATE = [0.25, 0.5, 0.875, 0.0]


def make_case(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 2
    teacher_logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 2
    teacher_lp = torch.log_softmax(teacher_logits, -1)
    return {
        "logits": logits,
        "teacher_lp": teacher_lp,
        "ids": logits.topk(K, dim=-1).indices,  # [B, T, K]
        "sampled": torch.randint(0, V, (B, T), generator=gen),
        "old_shift": 0.4 * torch.randn(B, T, generator=gen, dtype=torch.float64),
        "advantages": torch.tensor([0.7, -0.4, 0.0, -1.1], dtype=torch.float64),
        "entropy": -(teacher_lp.exp() * teacher_lp).sum(-1),  # [B, T] the teacher's, over all V
        "response_mask": torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None],
    }


def loss_inputs(case: dict, leaf: torch.Tensor, **extra) -> LossInputs:
    student_lp = torch.log_softmax(leaf, -1)
    token = student_lp.gather(-1, case["sampled"][..., None])[..., 0]
    return LossInputs(
        student_token_logprobs=token,
        old_token_logprobs=token.detach() + case["old_shift"],
        response_mask=case["response_mask"],
        sample_mask=torch.tensor(SAMPLE_MASK),
        student_topk_logprobs=student_lp.gather(-1, case["ids"]),
        teacher_topk_logprobs=case["teacher_lp"].gather(-1, case["ids"]),
        advantages=case["advantages"],
        teacher_entropy=case["entropy"],
        pass_rate=torch.tensor(PASS_RATE, dtype=torch.float64),
        **extra,
    )


def run(inputs: LossInputs, *, loss_type: str, beta: float = 1.0, pass_rate_weight: bool = False, **kw):
    args = {"reduction": "dilute", "aggregation": "token-mean", **kw}
    return policy_loss(
        inputs,
        loss_type=loss_type,
        divergence="topk_tail",
        alpha=ALPHA,
        blend_lambda=0.0,
        is_clip=IS_CLIP,
        clip_low=CLIP_LOW,
        clip_high=CLIP_HIGH,
        srpo_beta=beta,
        pass_rate_weight=pass_rate_weight,
        **args,
    )


# -- the oracle, token by token ---------------------------------------------------------------


def jsd_with_tail(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """D_0.5 between the K+1-bucket distributions of two [K] full-vocabulary log-prob vectors."""
    p = torch.cat([student.exp(), (1 - student.exp().sum()).reshape(1)])
    q = torch.cat([teacher.exp(), (1 - teacher.exp().sum()).reshape(1)])
    m = 0.5 * p + 0.5 * q
    return 0.5 * (p * (p / m).log()).sum() + 0.5 * (q * (q / m).log()).sum()


def oracle(case: dict, leaf: torch.Tensor, *, sdpo: list[bool], grpo: list[bool], beta, pass_rate_weight, aggregation):
    student_lp = torch.log_softmax(leaf, -1)
    sdpo_tokens = [(b, t) for b in range(B) for t in range(LENGTHS[b]) if sdpo[b]]
    token_weight = {(b, t): 1.0 for b, t in sdpo_tokens}
    if beta is not None:
        raw = {(b, t): math.exp(-beta * float(case["entropy"][b, t])) for b, t in sdpo_tokens}
        mean = sum(raw.values()) / len(raw)
        token_weight = {key: value / mean for key, value in raw.items()}
    sample_weight = dict.fromkeys(range(B), 1.0)
    if pass_rate_weight:
        raw = {b: math.sqrt(p * (1 - p)) for b, p in enumerate(PASS_RATE)}
        mean = sum(raw[b] for b in range(B) if sdpo[b]) / sum(sdpo)
        sample_weight = {b: raw[b] / mean for b in range(B)}
    per_sample = []
    for b in range(B):
        terms = []
        for t in range(LENGTHS[b]):
            logp = student_lp[b, t, case["sampled"][b, t]]
            old = logp.detach() + case["old_shift"][b, t]
            if sdpo[b]:
                ids = case["ids"][b, t]
                divergence = jsd_with_tail(student_lp[b, t, ids], case["teacher_lp"][b, t, ids])
                is_weight = min(math.exp(float((logp - old).detach())), IS_CLIP)
                terms.append(token_weight[b, t] * sample_weight[b] * is_weight * divergence)
            elif grpo[b]:
                ratio = (logp - old).exp()
                adv = float(case["advantages"][b])
                clipped = ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH)
                terms.append(torch.maximum(-ratio * adv, -clipped * adv))
        per_sample.append(terms)
    if aggregation == "token-mean":  # every response token of the batch in the count
        return sum(sum(terms) for terms in per_sample if terms) / sum(LENGTHS)
    return sum(sum(terms) / LENGTHS[b] for b, terms in enumerate(per_sample) if terms) / B


def value_and_grad(fn, case):
    leaf = case["logits"].clone().requires_grad_(True)
    value = fn(leaf)
    (grad,) = torch.autograd.grad(value, leaf)
    return value.detach(), grad


def assert_matches(got, want):
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-9, atol=1e-12)


# -- SRPO -------------------------------------------------------------------------------------


@pytest.mark.parametrize("aggregation", ["token-mean", "sequence-mean"])
@pytest.mark.parametrize("beta", [1.0, 0.0, 2.5])
def test_srpo_loss_matches_the_oracle(aggregation, beta):
    case = make_case()
    route = torch.tensor(ROUTE)
    got = value_and_grad(
        lambda z: (
            run(loss_inputs(case, z, route_sdpo=route), loss_type="srpo", beta=beta, aggregation=aggregation).loss
        ),
        case,
    )
    grpo = [not r for r in ROUTE]
    want = value_and_grad(
        lambda z: oracle(case, z, sdpo=ROUTE, grpo=grpo, beta=beta, pass_rate_weight=False, aggregation=aggregation),
        case,
    )
    assert_matches(got, want)
    assert got[1][1].abs().sum() > 0 and got[1][0].abs().sum() > 0  # both branches train


@pytest.mark.parametrize("reduction", ["exclude", "dilute"])
def test_srpo_does_not_depend_on_the_mask_reduction(reduction):
    """Every sample is routed one way or the other, so every response token is in the mean."""
    case = make_case(1)
    inputs = loss_inputs(case, case["logits"], route_sdpo=torch.tensor(ROUTE))
    dilute = run(inputs, loss_type="srpo", reduction="dilute")
    got = run(inputs, loss_type="srpo", reduction=reduction)
    torch.testing.assert_close(got.loss, dilute.loss)


def test_srpo_micro_batches_with_whole_batch_normalisers_sum_to_the_batch_loss():
    case = make_case(2)
    route = torch.tensor(ROUTE)
    response = case["response_mask"]
    denominator = loss_denominator(
        response, torch.ones(B, dtype=torch.bool), reduction="dilute", aggregation="token-mean"
    )
    norm = weight_norm(entropy_weights(case["entropy"], beta=1.0), response & route[:, None])

    def micro(z):
        full = loss_inputs(case, z, route_sdpo=route)
        total = 0.0
        for rows in ([0, 1], [2, 3]):
            part = LossInputs(
                **{
                    name: value[rows] if isinstance(value, torch.Tensor) else value
                    for name, value in full.__dict__.items()
                },
            )
            part = LossInputs(**{**part.__dict__, "grpo_denominator": denominator, "entropy_weight_norm": norm})
            total = total + run(part, loss_type="srpo").loss
        return total

    whole = value_and_grad(lambda z: run(loss_inputs(case, z, route_sdpo=route), loss_type="srpo").loss, case)
    assert_matches(value_and_grad(micro, case), whole)


def test_srpo_with_every_sample_on_one_side_is_the_pure_loss():
    case = make_case(3)
    everyone = torch.ones(B, dtype=torch.bool)
    inputs = loss_inputs(case, case["logits"], route_sdpo=torch.zeros(B, dtype=torch.bool))
    torch.testing.assert_close(run(inputs, loss_type="srpo").loss, run(inputs, loss_type="grpo").loss)
    # all routed to SDPO, unweighted (beta = 0): SDPO with every sample taught
    taught = LossInputs(**{**inputs.__dict__, "sample_mask": everyone, "route_sdpo": everyone})
    torch.testing.assert_close(run(taught, loss_type="srpo", beta=0.0).loss, run(taught, loss_type="sdpo").loss)


def test_srpo_branch_losses_add_up_and_metrics_are_counted():
    case = make_case(4)
    out = run(loss_inputs(case, case["logits"], route_sdpo=torch.tensor(ROUTE)), loss_type="srpo")
    assert out.metrics["sdpo/loss"] + out.metrics["grpo/loss"] == pytest.approx(out.metrics["loss/total"])
    sdpo_tokens = LENGTHS[0] + LENGTHS[2]
    assert out.metrics["sdpo/active_sample_fraction"] == pytest.approx(0.5)
    assert out.metrics["sdpo/active_token_fraction"] == pytest.approx(sdpo_tokens / sum(LENGTHS))
    assert out.metrics["srpo/entropy_weight_mean"] == pytest.approx(1.0)  # normalised over this batch
    assert out.metric_counts["srpo/entropy_weight_mean"] == sdpo_tokens
    assert out.metric_counts["grpo/clip_fraction"] == LENGTHS[1] + LENGTHS[3]
    assert out.metric_counts["grpo/advantage_mean"] == 2
    assert out.metrics["grpo/advantage_mean"] == pytest.approx((-0.4 - 1.1) / 2)
    assert 0 <= out.metrics["srpo/entropy_weight_low_share"] <= 1
    assert not {"sdpo/loss", "grpo/loss", "loss/total"} & set(out.metric_counts)


def test_srpo_refuses_a_sample_routed_to_sdpo_without_a_teacher_and_missing_inputs():
    case = make_case()
    routed_untaught = torch.tensor([False, False, False, True])  # sample 3 has sample_mask False
    with pytest.raises(ValueError, match=r"samples \[3\] are routed to SDPO but have no teacher"):
        run(loss_inputs(case, case["logits"], route_sdpo=routed_untaught), loss_type="srpo")
    with pytest.raises(ValueError, match="route_sdpo"):
        run(loss_inputs(case, case["logits"]), loss_type="srpo")
    bare = LossInputs(**{**loss_inputs(case, case["logits"], route_sdpo=torch.tensor(ROUTE)).__dict__})
    with pytest.raises(ValueError, match="teacher_entropy"):
        run(LossInputs(**{**bare.__dict__, "teacher_entropy": None}), loss_type="srpo")
    with pytest.raises(TypeError, match="route_sdpo"):
        LossInputs(**{**bare.__dict__, "route_sdpo": torch.ones(B)})
    with pytest.raises(ValueError, match="teacher_entropy must be"):
        LossInputs(**{**bare.__dict__, "teacher_entropy": torch.zeros(B, T + 1)})


def test_entropy_weights_favour_confident_teacher_tokens_and_reject_bad_values():
    entropy = torch.tensor([[0.0, 1.0, 3.0]], dtype=torch.float64)
    raw = entropy_weights(entropy, beta=1.0)
    torch.testing.assert_close(raw, torch.exp(-entropy))
    weights = normalised(raw, torch.ones_like(entropy, dtype=torch.bool), norm=None)
    assert float(weights.mean()) == pytest.approx(1.0) and weights[0, 0] > weights[0, 1] > weights[0, 2]
    assert torch.equal(entropy_weights(entropy, beta=0.0), torch.ones_like(entropy))
    with pytest.raises(ValueError, match="beta=-1"):
        entropy_weights(entropy, beta=-1.0)
    with pytest.raises(ValueError, match="-0.5"):
        entropy_weights(torch.tensor([-0.5]), beta=1.0)


# -- pass-rate weighted SDPO ------------------------------------------------------------------


@pytest.mark.parametrize("aggregation", ["token-mean", "sequence-mean"])
def test_pass_rate_weighted_sdpo_matches_the_oracle(aggregation):
    case = make_case(5)
    got = value_and_grad(
        lambda z: run(loss_inputs(case, z), loss_type="sdpo", pass_rate_weight=True, aggregation=aggregation).loss,
        case,
    )
    want = value_and_grad(
        lambda z: oracle(
            case, z, sdpo=SAMPLE_MASK, grpo=[False] * B, beta=None, pass_rate_weight=True, aggregation=aggregation
        ),
        case,
    )
    assert_matches(got, want)


def test_pass_rate_weights_combine_with_srpo_routing():
    case = make_case(6)
    route = torch.tensor(ROUTE)
    got = value_and_grad(
        lambda z: run(loss_inputs(case, z, route_sdpo=route), loss_type="srpo", pass_rate_weight=True).loss, case
    )
    grpo = [not r for r in ROUTE]
    want = value_and_grad(
        lambda z: oracle(case, z, sdpo=ROUTE, grpo=grpo, beta=1.0, pass_rate_weight=True, aggregation="token-mean"),
        case,
    )
    assert_matches(got, want)


def test_equal_pass_rates_leave_sdpo_unchanged_and_settled_questions_train_nothing():
    case = make_case(7)
    inputs = loss_inputs(case, case["logits"])
    equal = LossInputs(**{**inputs.__dict__, "pass_rate": torch.full((B,), 0.375, dtype=torch.float64)})
    plain = run(inputs, loss_type="sdpo")
    torch.testing.assert_close(run(equal, loss_type="sdpo", pass_rate_weight=True).loss, plain.loss)

    settled = torch.tensor([1.0, 0.0, 1.0, 0.5], dtype=torch.float64)  # the taught samples: all or none solved
    leaf = case["logits"].clone().requires_grad_(True)
    out = run(
        LossInputs(**{**loss_inputs(case, leaf).__dict__, "pass_rate": settled}),
        loss_type="sdpo",
        pass_rate_weight=True,
    )
    (grad,) = torch.autograd.grad(out.loss, leaf)
    assert out.loss.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad))
    assert all(math.isfinite(v) for v in out.metrics.values())


def test_pass_rate_micro_batches_with_whole_batch_normalisers_sum_to_the_batch_loss():
    case = make_case(8)
    response, mask = case["response_mask"], torch.tensor(SAMPLE_MASK)
    kw = {"reduction": "exclude", "aggregation": "sequence-mean"}
    denominator = loss_denominator(response, mask, **kw)
    norm = weight_norm(question_weights(torch.tensor(PASS_RATE, dtype=torch.float64)), mask)

    def micro(z):
        full = loss_inputs(case, z)
        total = 0.0
        for rows in ([0], [1, 2], [3]):
            part = {n: v[rows] if isinstance(v, torch.Tensor) else v for n, v in full.__dict__.items()}
            part.update(sdpo_denominator=denominator, question_weight_norm=norm)
            total = total + run(LossInputs(**part), loss_type="sdpo", pass_rate_weight=True, **kw).loss
        return total

    whole = value_and_grad(
        lambda z: run(loss_inputs(case, z), loss_type="sdpo", pass_rate_weight=True, **kw).loss, case
    )
    assert_matches(value_and_grad(micro, case), whole)


def test_question_weights_are_the_group_reward_std_and_reject_bad_rates():
    rates = torch.tensor([0.0, 0.25, 0.5, 1.0], dtype=torch.float64)
    torch.testing.assert_close(
        question_weights(rates), torch.tensor([0.0, math.sqrt(3) / 4, 0.5, 0.0], dtype=torch.float64)
    )
    # for 0/1 rewards in a group of 8 with 2 successes: the population std of the rewards
    rewards = torch.tensor([1.0, 1.0, 0, 0, 0, 0, 0, 0], dtype=torch.float64)
    assert float(question_weights(torch.tensor(0.25, dtype=torch.float64))) == pytest.approx(
        float(rewards.std(correction=0))
    )
    with pytest.raises(ValueError, match="1.5"):
        question_weights(torch.tensor([1.5]))
    with pytest.raises(ValueError, match="pass_rate"):
        run(
            LossInputs(**{**loss_inputs(make_case(), make_case()["logits"]).__dict__, "pass_rate": None}),
            loss_type="sdpo",
            pass_rate_weight=True,
        )
