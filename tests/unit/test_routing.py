"""SRPO's routing rule, the questions' pass rates, and the teacher stage's metrics of both."""

from __future__ import annotations

import math

import pytest
import torch

from sdpo_core.feedback import RelaxSDPOFeedback, SDPOFeedback
from sdpo_core.records import SampleRecord
from sdpo_core.routing import (
    entropy_metrics,
    pass_rates,
    question_weight_metrics,
    route_samples,
    routing_metrics,
)


def make(sample_id, reward, *, group_id=0, text=None, feedback=None) -> SampleRecord:
    return SampleRecord(
        sample_id=sample_id,
        group_id=group_id,
        prompt_messages=({"role": "user", "content": "2+2="},),
        response_text=f"answer-{sample_id}" if text is None else text,
        reward=reward,
        feedback=feedback,
        finish_reason="stop",
    )


def routed(policy, group, rule="failed_with_solution"):
    contexts = policy.prepare_group(group)
    return route_samples(group, contexts, success_threshold=policy.success_threshold, rule=rule)


def test_failures_with_a_successful_sibling_go_to_sdpo_everything_else_to_grpo():
    policy = SDPOFeedback(include_environment_feedback=False)
    mixed = [make(0, 1.0), make(1, 0.0), make(2, 0.0), make(3, 1.0)]
    assert routed(policy, mixed) == ["grpo", "sdpo", "sdpo", "grpo"]  # successes to GRPO even when taught
    assert routed(policy, [make(i, 0.0, group_id=1) for i in range(4)]) == ["grpo"] * 4  # nothing to learn from
    lone = [make(0, 0.0), make(1, 1.0), make(2, 0.0)]
    assert routed(policy, lone) == ["sdpo", "grpo", "sdpo"]  # the lone success teaches its siblings


def test_the_threshold_is_the_feedback_policys():
    group = [make(0, 0.6), make(1, 0.4), make(2, 0.9)]
    assert routed(SDPOFeedback(success_threshold=0.5), group) == ["grpo", "sdpo", "grpo"]
    # at 0.8 the 0.6 answer failed too, and 0.9 teaches both failures
    assert routed(SDPOFeedback(success_threshold=0.8), group) == ["sdpo", "sdpo", "grpo"]
    assert routed(SDPOFeedback(success_threshold=1.0), group) == ["grpo"] * 3


def test_a_success_that_shows_nothing_does_not_count_as_a_teacher():
    """A success cut off inside <think> has an empty demonstration: its failed siblings have no teacher."""
    policy = SDPOFeedback(include_environment_feedback=False)
    group = [make(0, 1.0, text="<think>the answer is 4"), make(1, 0.0)]
    assert routed(policy, group) == ["grpo", "grpo"]


def test_feedback_teaches_failures_only_under_the_teacher_rule():
    policy = SDPOFeedback(include_environment_feedback=True)
    group = [make(0, 0.0, feedback="Expected 4."), make(1, 0.0, feedback="Expected 4.")]
    assert routed(policy, group, rule="failed_with_solution") == ["grpo", "grpo"]  # the paper: all wrong -> GRPO
    assert routed(policy, group, rule="failed_with_teacher") == ["sdpo", "sdpo"]
    no_feedback = [make(0, 0.0), make(1, 0.0, feedback="Expected 4.")]
    assert routed(policy, no_feedback, rule="failed_with_teacher") == ["grpo", "sdpo"]


def test_the_relax_policy_routes_the_same_way():
    policy = RelaxSDPOFeedback(success_threshold=1.0)
    group = [make(0, 1.0), make(1, 0.0), make(2, 0.5)]
    assert routed(policy, group) == ["grpo", "sdpo", "sdpo"]


def test_route_samples_pairs_by_sample_id_and_refuses_bad_arguments():
    policy = SDPOFeedback()
    group = [make(0, 1.0), make(1, 0.0)]
    contexts = policy.prepare_group(group)
    reversed_contexts = list(reversed(contexts))
    assert route_samples(group, reversed_contexts, success_threshold=0.5, rule="failed_with_solution") == [
        "grpo",
        "sdpo",
    ]
    with pytest.raises(ValueError, match="one to one"):
        route_samples(group, contexts[:1], success_threshold=0.5, rule="failed_with_solution")
    with pytest.raises(ValueError, match="'always'"):
        route_samples(group, contexts, success_threshold=0.5, rule="always")
    with pytest.raises(ValueError, match="nan"):
        route_samples(group, contexts, success_threshold=math.nan, rule="failed_with_solution")


def test_pass_rates_are_each_groups_share_of_successes_the_sample_included():
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.2]
    groups = [7, 7, 7, 7, 3, 3, 9, 9]  # any ids, any order
    assert pass_rates(rewards, groups, success_threshold=0.5) == [0.25] * 4 + [1.0, 1.0, 0.5, 0.5]
    assert pass_rates([1.0, 0.0, 1.0], [2, 5, 2], success_threshold=1.0) == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="differ in length"):
        pass_rates([1.0], [0, 0], success_threshold=0.5)
    with pytest.raises(ValueError, match="inf"):
        pass_rates([math.inf], [0], success_threshold=0.5)


def test_stage_metrics_of_routes_entropies_and_question_weights():
    entropy = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 0.5], dtype=torch.float64)
    everything = entropy_metrics(entropy)
    assert everything["teacher/entropy_mean"] == pytest.approx(10.5 / 6)
    assert everything["teacher/entropy_p50"] in (1.0, 2.0) and everything["teacher/entropy_p10"] == 0.0

    # samples of 2, 3 and 1 tokens; the first and the last routed to SDPO
    sdpo_tokens = torch.tensor([True, True, False, False, False, True])
    metrics = routing_metrics(["sdpo", "grpo", "sdpo"], entropy, sdpo_tokens, beta=1.0)
    assert metrics["srpo/routed_sdpo_share"] == pytest.approx(2 / 3)
    assert metrics["srpo/routed_grpo_share"] == pytest.approx(1 / 3)
    assert metrics["srpo/teacher_entropy_mean"] == pytest.approx(1.5 / 3)
    raw = [1.0, math.exp(-1.0), math.exp(-0.5)]
    assert metrics["srpo/entropy_weight_max"] == pytest.approx(1.0 / (sum(raw) / 3))
    assert metrics["srpo/entropy_weight_p50"] == pytest.approx(raw[2] / (sum(raw) / 3))
    assert "srpo/entropy_weight_mean" not in metrics  # 1 by construction; the trainer logs it per step
    with pytest.raises(ValueError, match="'blend'"):
        routing_metrics(["blend"], entropy[:1], sdpo_tokens[:1], beta=1.0)

    rates = torch.tensor([0.5, 1.0, 0.25, 0.0], dtype=torch.float64)
    q = question_weight_metrics(rates, torch.tensor([True, True, True, False]))
    assert q["sdpo/pass_rate_mean"] == pytest.approx(1.75 / 3)
    assert q["sdpo/question_weight_zero_share"] == pytest.approx(1 / 3)
    raw_q = [0.5, 0.0, math.sqrt(3) / 4]
    assert q["sdpo/question_weight_p90"] == pytest.approx(0.5 / (sum(raw_q) / 3))
    empty = routing_metrics([], torch.zeros(0), torch.zeros(0, dtype=torch.bool), beta=1.0)
    assert all(v == 0.0 for v in empty.values())
