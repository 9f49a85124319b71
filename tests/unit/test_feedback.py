"""Feedback policies (OPD, OPSD, SDPO, Relax SDPO), their loader, and teacher-context metrics."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import pytest

from sdpo_core.feedback import (
    FEEDBACK_POLICIES,
    FeedbackPolicy,
    OPDFeedback,
    OPSDFeedback,
    RelaxSDPOFeedback,
    SDPOFeedback,
    load_feedback,
)
from sdpo_core.metrics import teacher_context_metrics, warn_if_inactive
from sdpo_core.records import SampleRecord, TeacherContext, Verdict
from sdpo_core.teacher_context import render_reprompt

SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "Solve {x}: x+1=3"}


def make(
    sample_id,
    reward,
    *,
    group_id=0,
    text=None,
    feedback=None,
    finish_reason="stop",
    format_error=False,
    teacher_prompt=None,
) -> SampleRecord:
    return SampleRecord(
        sample_id=sample_id,
        group_id=group_id,
        prompt_messages=(dict(SYSTEM), dict(USER)),
        response_text=f"answer-{sample_id}" if text is None else text,
        reward=reward,
        feedback=feedback,
        finish_reason=finish_reason,
        format_error=format_error,
        teacher_prompt=teacher_prompt,
    )


def user_text(context: TeacherContext) -> str:
    return context.messages[-1]["content"]


# --------------------------------------------------------------------------- record_feedback


def test_record_feedback_copies_verdict_into_a_new_record():
    sample = make(0, 0.0)
    out = SDPOFeedback().record_feedback(sample, Verdict(reward=1.0, feedback="good", format_error=True))
    assert (out.reward, out.feedback, out.format_error) == (1.0, "good", True)
    assert (sample.reward, sample.feedback, sample.format_error) == (0.0, None, False)


def test_record_feedback_stores_blank_feedback_as_none():
    out = OPDFeedback().record_feedback(make(0, 0.0), Verdict(reward=0.0, feedback="  "))
    assert out.feedback is None


def test_record_feedback_rejects_truncated_verdict_for_untruncated_response():
    with pytest.raises(ValueError, match="sample 3.*finish_reason='stop'"):
        OPDFeedback().record_feedback(make(3, 0.0), Verdict(reward=0.0, truncated=True))
    out = OPDFeedback().record_feedback(make(3, 0.0, finish_reason="length"), Verdict(reward=0.0, truncated=True))
    assert out.truncated


def test_verdict_rejects_nan_reward():
    with pytest.raises(ValueError, match="finite"):
        Verdict(reward=float("nan"))


# --------------------------------------------------------------------------- group checks


@pytest.mark.parametrize("policy", [OPDFeedback(), SDPOFeedback(), RelaxSDPOFeedback()])
def test_mixed_group_ids_raise(policy):
    with pytest.raises(ValueError, match=r"share group_id; got group_ids \[0, 1\]"):
        policy.prepare_group([make(0, 1.0, group_id=0), make(1, 0.0, group_id=1)])


def test_empty_group_and_duplicate_ids_raise():
    with pytest.raises(ValueError, match="non-empty"):
        SDPOFeedback().prepare_group([])
    with pytest.raises(ValueError, match=r"duplicate sample_id in group 0: \[5\]"):
        SDPOFeedback().prepare_group([make(5, 1.0), make(5, 0.0)])


# --------------------------------------------------------------------------- OPD / OPSD


def test_opd_teacher_sees_student_prompt_and_trains_everything():
    group = [make(0, 0.0), make(1, 1.0)]
    contexts = OPDFeedback().prepare_group(group)
    assert [c.mask for c in contexts] == [True, True]
    assert [c.source for c in contexts] == ["none", "none"]
    assert all(c.messages == group[0].prompt_messages for c in contexts)


def test_opsd_replaces_last_user_message_with_teacher_prompt():
    group = [make(0, 0.0, teacher_prompt="Hint: x=2. {keep}"), make(1, 1.0, teacher_prompt="Hint B")]
    contexts = OPSDFeedback().prepare_group(group)
    assert [c.mask for c in contexts] == [True, True]
    assert contexts[0].source == "prompt"
    assert contexts[0].messages == (SYSTEM, {"role": "user", "content": "Hint: x=2. {keep}"})
    assert user_text(contexts[1]) == "Hint B"


def test_opsd_missing_teacher_prompt_names_sample():
    with pytest.raises(ValueError, match="sample 8 .*no teacher_prompt"):
        OPSDFeedback().prepare_group([make(7, 0.0, teacher_prompt="ok"), make(8, 0.0)])


# --------------------------------------------------------------------------- SDPO (paper policy)


def test_sdpo_lone_success_gets_no_signal_and_failed_peers_distil_toward_it():
    group = [make(0, 0.0), make(1, 1.0, text="<think>hmm</think>\nx = 2"), make(2, 0.0)]
    contexts = SDPOFeedback().prepare_group(group)
    assert [c.mask for c in contexts] == [True, False, True]
    assert [c.source for c in contexts] == ["solution", "none", "solution"]
    assert contexts[1].messages == group[1].prompt_messages
    expected = render_reprompt(USER["content"], solution="x = 2", feedback=None)
    assert user_text(contexts[0]) == expected and user_text(contexts[2]) == expected
    assert contexts[0].messages[0] == SYSTEM


@pytest.mark.parametrize("policy_class", [SDPOFeedback, RelaxSDPOFeedback])
def test_a_success_cut_off_inside_think_is_no_demonstration(policy_class):
    """Stripped of its unclosed reasoning it is empty: its peers must not train toward nothing."""
    cut = "<think>step one, step two, and then"
    group = [make(0, 0.0), make(1, 1.0, text=cut), make(2, 1.0, text="<think>ok</think> x = 2"), make(3, 0.0)]
    contexts = policy_class(remove_thinking_from_demonstration=True).prepare_group(group)
    demos = policy_class(remove_thinking_from_demonstration=True).demonstrations(group)
    assert demos[0] == 2 and demos[3] == 2 and demos[1] == 2  # the cut-off success is skipped
    assert "x = 2" in user_text(contexts[0]) and cut not in user_text(contexts[0])
    alone = [make(0, 0.0), make(1, 1.0, text=cut)]
    contexts = policy_class(remove_thinking_from_demonstration=True).prepare_group(alone)
    assert [c.source for c in contexts] == ["none", "none"] and not any(c.mask for c in contexts)


def test_sdpo_two_successes_teach_each_other():
    group = [make(0, 1.0, text="A"), make(1, 1.0, text="B"), make(2, 0.0)]
    contexts = SDPOFeedback().prepare_group(group)
    assert [c.mask for c in contexts] == [True, True, True]
    assert "\n\nB\n" in user_text(contexts[0])
    assert "\n\nA\n" in user_text(contexts[1]) and "\n\nA\n" in user_text(contexts[2])


def test_sdpo_self_success_allowed_gives_lone_success_signal():
    contexts = SDPOFeedback(dont_reprompt_on_self_success=False).prepare_group([make(0, 1.0), make(1, 0.0)])
    assert [c.mask for c in contexts] == [True, True]


def test_sdpo_default_threshold_is_half():
    assert SDPOFeedback().success_threshold == 0.5
    contexts = SDPOFeedback().prepare_group([make(0, 0.5, text="half"), make(1, 0.0)])
    assert [c.mask for c in contexts] == [False, True]


def test_sdpo_feedback_used_only_without_solution_by_default():
    group = [make(0, 1.0, text="S"), make(1, 0.0, feedback="off by one"), make(2, 0.0)]
    contexts = SDPOFeedback().prepare_group(group)
    assert [c.source for c in contexts] == ["none", "solution", "solution"]
    assert "off by one" not in user_text(contexts[1])

    failing = [make(0, 0.0, feedback="off by one"), make(1, 0.0)]
    contexts = SDPOFeedback().prepare_group(failing)
    assert [c.source for c in contexts] == ["feedback", "none"]
    assert [c.mask for c in contexts] == [True, False]
    assert user_text(contexts[0]) == render_reprompt(USER["content"], solution=None, feedback="off by one")


def test_sdpo_feedback_with_solution_when_allowed():
    group = [make(0, 1.0, text="S"), make(1, 0.0, feedback="off by one")]
    contexts = SDPOFeedback(environment_feedback_only_without_solution=False).prepare_group(group)
    assert contexts[1].source == "solution+feedback"
    assert user_text(contexts[1]) == render_reprompt(USER["content"], solution="S", feedback="off by one")


def test_sdpo_feedback_disabled():
    contexts = SDPOFeedback(include_environment_feedback=False).prepare_group([make(0, 0.0, feedback="fb")])
    assert (contexts[0].mask, contexts[0].source) == (False, "none")


def test_sdpo_thinking_kept_when_asked():
    group = [make(0, 1.0, text="<think>r</think>A"), make(1, 0.0)]
    contexts = SDPOFeedback(remove_thinking_from_demonstration=False).prepare_group(group)
    assert "<think>r</think>A" in user_text(contexts[1])


def test_sdpo_demo_truncated_not_the_prompt():
    group = [make(0, 1.0, text="0123456789"), make(1, 0.0)]
    contexts = SDPOFeedback(max_demo_chars=4).prepare_group(group)
    assert user_text(contexts[1]) == render_reprompt(USER["content"], solution="0123", feedback=None)
    assert user_text(contexts[1]).endswith("Correctly solve the original question.")
    with pytest.raises(ValueError, match="10 characters, more than max_chars=4"):
        SDPOFeedback(max_demo_chars=4, demo_overflow="error").prepare_group(group)


def test_sdpo_braces_survive_in_demo_and_feedback():
    group = [make(0, 1.0, text="return {'a': {b}}"), make(1, 0.0, feedback="{feedback_raw} {0}")]
    contexts = SDPOFeedback(environment_feedback_only_without_solution=False).prepare_group(group)
    text = user_text(contexts[1])
    assert "Solve {x}: x+1=3" in text and "return {'a': {b}}" in text and "{feedback_raw} {0}" in text


def test_sdpo_bad_template_rejected_at_construction():
    with pytest.raises(ValueError, match="solution_template"):
        SDPOFeedback(solution_template="Correct: {solution}")


def test_policies_never_mutate_input_messages():
    group = [make(0, 1.0, teacher_prompt="T0"), make(1, 0.0, feedback="fb", format_error=True, teacher_prompt="T1")]
    before = copy.deepcopy([s.prompt_messages for s in group])
    for policy in (OPDFeedback(), OPSDFeedback(), SDPOFeedback(), RelaxSDPOFeedback()):
        contexts = policy.prepare_group(group)
        for c in contexts:
            for m in c.messages:
                m["content"] = "scribbled"
        assert [s.prompt_messages for s in group] == before


# --------------------------------------------------------------------------- Relax SDPO


RELAX_END = "\n\nNow produce the best answer to the original problem."


def relax_demo(text: str) -> str:
    return f"{USER['content']}\n\n<successful_attempt>\n{text}\n</successful_attempt>{RELAX_END}"


def test_relax_success_prefers_peer():
    group = [make(0, 1.0, text="A"), make(1, 1.0, text="B")]
    contexts = RelaxSDPOFeedback().prepare_group(group)
    assert [c.mask for c in contexts] == [True, True]
    assert user_text(contexts[0]) == relax_demo("B") and user_text(contexts[1]) == relax_demo("A")


def test_relax_lone_success_falls_back_to_itself():
    contexts = RelaxSDPOFeedback().prepare_group([make(0, 0.0), make(1, 1.0, text="mine")])
    assert (contexts[1].mask, contexts[1].source) == (True, "solution")
    assert user_text(contexts[1]) == relax_demo("mine")


def test_relax_failure_with_peer_drops_own_feedback():
    group = [make(0, 0.0, feedback="format broken", format_error=True), make(1, 1.0, text="good")]
    contexts = RelaxSDPOFeedback().prepare_group(group)
    assert (contexts[0].mask, contexts[0].source) == (True, "solution")
    assert user_text(contexts[0]) == relax_demo("good")
    assert "format broken" not in user_text(contexts[0])


@pytest.mark.parametrize(("format_error", "finish_reason"), [(True, "stop"), (False, "length")])
def test_relax_format_error_or_truncation_without_peer_injects_feedback(format_error, finish_reason):
    group = [make(0, 0.0, feedback="bad {format}", format_error=format_error, finish_reason=finish_reason)]
    contexts = RelaxSDPOFeedback().prepare_group(group)
    assert (contexts[0].mask, contexts[0].source) == (True, "feedback")
    assert user_text(contexts[0]) == f"{USER['content']}\n\n<feedback>\nbad {{format}}\n</feedback>{RELAX_END}"


def test_relax_ordinary_wrong_answer_without_peer_is_masked():
    group = [make(0, 0.0, feedback="wrong answer"), make(1, 0.0)]
    contexts = RelaxSDPOFeedback().prepare_group(group)
    assert [(c.mask, c.source) for c in contexts] == [(False, "none"), (False, "none")]
    assert contexts[0].messages == group[0].prompt_messages


@pytest.mark.parametrize(("threshold", "mask"), [(1.0, False), (0.8, True)])
def test_relax_threshold_configurable(threshold, mask):
    contexts = RelaxSDPOFeedback(success_threshold=threshold).prepare_group([make(0, 0.9)])
    assert contexts[0].mask is mask


# --------------------------------------------------------------------------- load_feedback


@pytest.mark.parametrize(("name", "cls"), sorted(FEEDBACK_POLICIES.items()))
def test_load_feedback_by_short_name(name, cls):
    assert type(load_feedback(name)) is cls


def test_registry_names():
    assert set(FEEDBACK_POLICIES) == {"opd", "opsd", "sdpo", "sdpo_relax"}


@pytest.mark.parametrize("spec", ["sdpo_core.feedback:SDPOFeedback", "sdpo_core.feedback.SDPOFeedback"])
def test_load_feedback_by_dotted_path_with_kwargs(spec):
    policy = load_feedback(spec, {"success_threshold": 0.8, "max_demo_chars": 100})
    assert isinstance(policy, SDPOFeedback)
    assert (policy.success_threshold, policy.max_demo_chars) == (0.8, 100)


def test_load_feedback_unknown_kwargs_named_with_accepted_list():
    expected = r"unknown kwargs \['success_reward_threshold'\]; accepted: .*'success_threshold'"
    with pytest.raises(TypeError, match=expected):
        load_feedback("sdpo_relax", {"success_reward_threshold": 0.8})
    with pytest.raises(TypeError, match=r"unknown kwargs \['x'\]"):
        load_feedback("opd", {"x": 1})


class NotAPolicy:
    pass


@dataclass(frozen=True, kw_only=True)
class NeedsArg(FeedbackPolicy):
    level: int

    def prepare_group(self, group):
        return []


def test_load_feedback_non_subclass_raises_type_error():
    with pytest.raises(TypeError, match="not a FeedbackPolicy subclass"):
        load_feedback(f"{__name__}:NotAPolicy")
    with pytest.raises(TypeError, match="not a FeedbackPolicy subclass"):
        load_feedback("logging.getLogger")
    with pytest.raises(TypeError, match="abstract"):
        load_feedback("sdpo_core.feedback:FeedbackPolicy")


def test_load_feedback_custom_subclass_and_missing_kwarg():
    assert load_feedback(f"{__name__}:NeedsArg", {"level": 2}).level == 2
    with pytest.raises(TypeError, match=r"needs kwargs \['level'\]"):
        load_feedback(f"{__name__}:NeedsArg")


def test_load_feedback_unknown_name_raises():
    with pytest.raises(ValueError, match="unknown feedback policy 'grpo'"):
        load_feedback("grpo")


# --------------------------------------------------------------------------- metrics


def test_metrics_hand_example():
    # Group 0: one success (id 1), id 0 has feedback. Group 1: all fail; id 2 has feedback, id 3 none.
    samples = [
        make(0, 0.0, group_id=0, feedback="fb0"),
        make(1, 1.0, group_id=0),
        make(2, 0.0, group_id=1, feedback="fb2"),
        make(3, 0.0, group_id=1),
    ]
    policy = SDPOFeedback()
    contexts = policy.prepare_group(samples[:2]) + policy.prepare_group(samples[2:])
    # id 0: solution (its feedback unused); id 1: none; id 2: feedback; id 3: none.
    assert [c.source for c in contexts] == ["solution", "none", "feedback", "none"]
    metrics = teacher_context_metrics(samples, list(reversed(contexts)), success_threshold=0.5)
    assert metrics == {
        "sdpo/success_group_fraction": 0.5,
        "sdpo/success_sample_fraction": 0.25,
        "sdpo/feedback_available_fraction": 0.5,
        "sdpo/feedback_used_fraction": 0.25,
        "sdpo/solution_used_fraction": 0.25,
        "sdpo/reprompt_sample_fraction": 0.5,
        "sdpo/sample_mask_fraction": 0.5,
        "sdpo/empty_target_batch": 0.0,
    }


def test_metrics_reject_unpaired_contexts():
    samples = [make(0, 0.0), make(1, 0.0)]
    contexts = OPDFeedback().prepare_group(samples[:1])
    with pytest.raises(ValueError, match=r"only in samples: \[1\]"):
        teacher_context_metrics(samples, contexts, success_threshold=1.0)


def test_warn_if_inactive_is_rate_limited_and_names_settings(caplog):
    samples = [make(0, 0.0), make(1, 0.0)]
    metrics = teacher_context_metrics(samples, SDPOFeedback().prepare_group(samples), success_threshold=0.5)
    assert metrics["sdpo/empty_target_batch"] == 1.0
    log = logging.getLogger("tests.unit.test_feedback.inactive")
    now = [1000.0]
    with caplog.at_level(logging.WARNING, logger=log.name):
        assert warn_if_inactive(metrics, logger=log, min_interval_s=60, clock=lambda: now[0])
        now[0] += 59
        assert not warn_if_inactive(metrics, logger=log, min_interval_s=60, clock=lambda: now[0])
        now[0] += 2
        assert warn_if_inactive(metrics, logger=log, min_interval_s=60, clock=lambda: now[0])
    assert len(caplog.records) == 2
    message = caplog.records[0].getMessage()
    for setting in ("teacher.feedback_kwargs.success_threshold", "include_environment_feedback", "rollout.group_size"):
        assert setting in message


def test_warn_if_inactive_silent_when_some_sample_trains(caplog):
    samples = [make(0, 1.0), make(1, 0.0)]
    metrics = teacher_context_metrics(samples, SDPOFeedback().prepare_group(samples), success_threshold=0.5)
    log = logging.getLogger("tests.unit.test_feedback.active")
    with caplog.at_level(logging.WARNING, logger=log.name):
        assert not warn_if_inactive(metrics, logger=log)
    assert caplog.records == []


# --------------------------------------------------------------------------- demonstrations


@pytest.mark.parametrize(
    "policy",
    [
        SDPOFeedback(),
        SDPOFeedback(dont_reprompt_on_self_success=False),
        RelaxSDPOFeedback(),
        RelaxSDPOFeedback(success_threshold=0.5),
    ],
    ids=["sdpo", "sdpo-self", "relax", "relax-0.5"],
)
@pytest.mark.parametrize(
    "rewards", [[0.0, 1.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.6, 1.0, 0.6, 0.0]]
)
def test_demonstrations_name_the_answer_each_teacher_prompt_carries(policy, rewards):
    group = [make(i, r) for i, r in enumerate(rewards)]
    demos = policy.demonstrations(group)
    for context, demo in zip(policy.prepare_group(group), demos, strict=True):
        shown = [j for j in range(len(group)) if f"answer-{j}" in user_text(context)]
        assert shown == ([] if demo is None else [demo])


def test_policies_without_demonstrations_name_none():
    group = [make(0, 1.0, teacher_prompt="privileged"), make(1, 0.0, teacher_prompt="privileged")]
    assert OPDFeedback().demonstrations(group) == [None, None]
    assert OPSDFeedback().demonstrations(group) == [None, None]
