import math

import pytest
import torch

from sdpo_core.grpo import (
    clip_advantages,
    group_advantages,
    ppo_clip_loss,
    ppo_clipped_mask,
    ratio_capped_mask,
    running_abs_mean,
)
from sdpo_core.losses import LossInputs, policy_loss


@pytest.fixture
def grouped_rewards() -> tuple[torch.Tensor, torch.Tensor]:
    # Interleaved, non-contiguous ids: group 5 = {0, 2, 4}, group 2 = {1, 3}, group 9 = {5}.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5])
    group_ids = torch.tensor([5, 2, 5, 2, 5, 9])
    return rewards, group_ids


def test_group_advantages_subtract_group_mean(grouped_rewards):
    rewards, group_ids = grouped_rewards
    got = group_advantages(rewards, group_ids, normalize_std=False)
    expected = torch.tensor([1 / 3, -0.5, -2 / 3, 0.5, 1 / 3, 0.0])
    torch.testing.assert_close(got, expected)


def test_group_advantages_divide_by_unbiased_group_std(grouped_rewards):
    rewards, group_ids = grouped_rewards
    got = group_advantages(rewards, group_ids, normalize_std=True, eps=0.0)
    std5 = math.sqrt((1 / 9 + 4 / 9 + 1 / 9) / 2)  # group 5 rewards 1, 0, 1
    std2 = math.sqrt((0.25 + 0.25) / 1)  # group 2 rewards 0, 1
    expected = torch.tensor([1 / 3 / std5, -0.5 / std2, -2 / 3 / std5, 0.5 / std2, 1 / 3 / std5, 0.0])
    torch.testing.assert_close(got, expected)


def test_group_advantages_of_a_uniform_group_are_zero_with_std():
    got = group_advantages(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 0, 0]), normalize_std=True)
    assert torch.equal(got, torch.zeros(3))


def test_group_advantages_match_a_per_group_loop():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(40, generator=gen, dtype=torch.float64)
    group_ids = torch.randint(0, 7, (40,), generator=gen) * 13
    got = group_advantages(rewards, group_ids, normalize_std=True, eps=1e-6)
    for gid in group_ids.unique():
        members = group_ids == gid
        group = rewards[members]
        std = group.std() if group.numel() > 1 else torch.tensor(1.0, dtype=torch.float64)
        torch.testing.assert_close(got[members], (group - group.mean()) / (std + 1e-6))


def test_group_advantages_reject_bad_inputs():
    with pytest.raises(ValueError, match=r"\(3,\)"):
        group_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long), normalize_std=False)
    with pytest.raises(TypeError, match="integer"):
        group_advantages(torch.zeros(3), torch.zeros(3), normalize_std=False)


@pytest.fixture
def ppo_example() -> dict[str, torch.Tensor]:
    # Sample 0 has A=+1 with ratios 1.5, 0.5, 1.1; sample 1 has A=-1 with ratios 1.5, 0.5 (+ padding).
    ratios = torch.tensor([[1.5, 0.5, 1.1], [1.5, 0.5, 1.0]])
    old = torch.full((2, 3), -2.0)
    return {
        "logprobs": (old + ratios.log()).requires_grad_(True),
        "old_logprobs": old,
        "advantages": torch.tensor([1.0, -1.0]),
        "response_mask": torch.tensor([[True, True, True], [True, True, False]]),
    }


def test_ppo_clip_loss_hand_example(ppo_example):
    loss = ppo_clip_loss(**ppo_example, clip_low=0.2, clip_high=0.28)
    # A>0: min(1.5, 1.28) -> -1.28 (clipped), min(0.5, 0.8) -> -0.5, 1.1 inside -> -1.1.
    # A<0: min(-1.5, -1.28) -> 1.5, min(-0.5, -0.8) -> 0.8 (clipped); padding -> 0.
    torch.testing.assert_close(loss, torch.tensor([[-1.28, -0.5, -1.1], [1.5, 0.8, 0.0]]))


def test_ppo_clip_loss_gradient_vanishes_on_clipped_tokens(ppo_example):
    ppo_clip_loss(**ppo_example, clip_low=0.2, clip_high=0.28).sum().backward()
    grad = ppo_example["logprobs"].grad
    # d(-r A)/d logprob = -r A where unclipped; 0 where clipped or padded.
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.5, -1.1], [1.5, 0.0, 0.0]]))


def test_ppo_clipped_mask_and_fraction(ppo_example):
    clipped = ppo_clipped_mask(**ppo_example, clip_low=0.2, clip_high=0.28)
    assert clipped.tolist() == [[True, False, False], [False, True, False]]
    inputs = LossInputs(
        student_token_logprobs=ppo_example["logprobs"],
        old_token_logprobs=ppo_example["old_logprobs"],
        response_mask=ppo_example["response_mask"],
        sample_mask=torch.tensor([False, False]),
        advantages=ppo_example["advantages"],
    )
    out = policy_loss(
        inputs,
        loss_type="grpo",
        divergence="topk_tail",
        alpha=0.5,
        blend_lambda=1.0,
        is_clip=2.0,
        reduction="exclude",
        aggregation="token-mean",
        clip_low=0.2,
        clip_high=0.28,
        srpo_beta=1.0,
        pass_rate_weight=False,
    )
    assert out.metrics["grpo/clip_fraction"] == pytest.approx(2 / 5)
    assert out.metrics["grpo/ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 1.5 + 0.5) / 5)
    assert out.loss.item() == pytest.approx((-1.28 - 0.5 - 1.1 + 1.5 + 0.8) / 5)


def test_ppo_clip_loss_high_clip_is_separate(ppo_example):
    # With clip_high = 0.6 the ratio 1.5 of the positive sample is no longer clipped.
    loss = ppo_clip_loss(**ppo_example, clip_low=0.2, clip_high=0.6)
    assert loss[0, 0].item() == pytest.approx(-1.5)
    assert loss[1, 1].item() == pytest.approx(0.8)


def test_the_dual_clip_bounds_negative_advantages_and_flattens_their_gradient():
    # A = -2 at ratios 5, 1.4, 0.5 (the last PPO-clipped below); A = +1 at ratio 5 (never capped)
    ratios = torch.tensor([[5.0, 1.4, 0.5], [5.0, 1.0, 1.0]])
    old = torch.full((2, 3), -1.0)
    logprobs = (old + ratios.log()).requires_grad_(True)
    example = {
        "logprobs": logprobs,
        "old_logprobs": old,
        "advantages": torch.tensor([-2.0, 1.0]),
        "response_mask": torch.ones(2, 3, dtype=torch.bool),
    }
    loss = ppo_clip_loss(**example, clip_low=0.2, clip_high=0.28, ratio_cap=3.0)
    # A<0: r=5 costs min(5 * 2, 3 * 2) = 6; r=1.4: max(2.8, 2.56) = 2.8 < 6; r=0.5: max(1.0, 1.6) = 1.6.
    # A>0: min(5, 1.28) -> -1.28, then r=1 -> -1.
    torch.testing.assert_close(loss, torch.tensor([[6.0, 2.8, 1.6], [-1.28, -1.0, -1.0]]))
    loss.sum().backward()
    # the capped token gives no gradient; the others -r A where unclipped
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 2.8, 0.0], [0.0, -1.0, -1.0]]))
    capped = ratio_capped_mask(**{k: v.detach() if k == "logprobs" else v for k, v in example.items()}, ratio_cap=3.0)
    assert capped.tolist() == [[True, False, False], [False, False, False]]
    with pytest.raises(ValueError, match="must exceed 1 \\+ clip_high"):
        ppo_clip_loss(**example, clip_low=0.2, clip_high=0.28, ratio_cap=1.1)


def test_advantages_clip_at_a_multiple_of_their_running_mean():
    # running |A|: 10 earlier samples summing to 4, then these four (sum 4.5): mean 8.5 / 14
    advantages = torch.tensor([3.0, -1.0, 0.25, -0.25])
    total, count = running_abs_mean(advantages, previous_sum=4.0, previous_count=10.0)
    assert (total, count) == (8.5, 14.0)
    limit = 2.0 * 8.5 / 14.0
    clipped = clip_advantages(advantages, running_abs_mean=total / count, multiple=2.0)
    torch.testing.assert_close(clipped, torch.tensor([limit, -1.0, 0.25, -0.25]))
    assert torch.equal(clip_advantages(advantages, running_abs_mean=0.0, multiple=3.0), advantages)
    with pytest.raises(ValueError, match="must be > 0"):
        clip_advantages(advantages, running_abs_mean=1.0, multiple=0.0)
