"""Demonstration choice, reasoning stripping, length policy and templating of the teacher prompt."""

from __future__ import annotations

import copy

import pytest

from sdpo_core.teacher_context import (
    FEEDBACK_TEMPLATE,
    REPROMPT_TEMPLATE,
    SOLUTION_TEMPLATE,
    build_relax_teacher_messages,
    build_teacher_messages,
    check_template,
    fit_demonstration,
    render_reprompt,
    select_demonstrations,
    select_feedback,
    strip_thinking,
    substitute,
)


@pytest.fixture
def chat() -> list[dict]:
    return [
        {"role": "system", "content": "You are precise."},
        {"role": "user", "content": "What is 2+2?"},
    ]


# --------------------------------------------------------------------------- select_demonstrations


def test_lone_success_is_demo_for_peers_but_not_itself():
    demos = select_demonstrations([0.0, 1.0, 0.0, 0.0], [7, 7, 7, 7], success_threshold=0.5, exclude_self=True)
    assert demos == [1, None, 1, 1]


def test_lone_success_gets_itself_when_self_allowed():
    demos = select_demonstrations([0.0, 1.0, 0.0], [7, 7, 7], success_threshold=0.5, exclude_self=False)
    assert demos == [1, 1, 1]


def test_several_successes_first_by_index_and_first_gets_second():
    demos = select_demonstrations([0.0, 1.0, 0.0, 1.0, 1.0], [0] * 5, success_threshold=1.0, exclude_self=True)
    assert demos == [1, 3, 1, 1, 1]


def test_several_successes_without_self_exclusion_all_get_first():
    demos = select_demonstrations([0.0, 1.0, 1.0], [0] * 3, success_threshold=1.0, exclude_self=False)
    assert demos == [1, 1, 1]


def test_no_success_gives_no_demo():
    assert select_demonstrations([0.0, 0.2], [3, 3], success_threshold=0.5, exclude_self=True) == [None, None]
    assert select_demonstrations([0.0, 0.2], [3, 3], success_threshold=0.5, exclude_self=False) == [None, None]


@pytest.mark.parametrize(("threshold", "expected"), [(0.8, [None, 0]), (1.0, [None, None])])
def test_threshold_decides_whether_point_nine_counts(threshold, expected):
    assert select_demonstrations([0.9, 0.0], [0, 0], success_threshold=threshold, exclude_self=True) == expected


def test_reward_equal_to_threshold_is_a_success():
    assert select_demonstrations([0.0, 0.5], [0, 0], success_threshold=0.5, exclude_self=True) == [1, None]


def test_non_contiguous_groups_never_share():
    rewards = [0.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    groups = [1, 2, 1, 2, 1, 3]
    demos = select_demonstrations(rewards, groups, success_threshold=1.0, exclude_self=True)
    # group 1: indices 0, 2, 4 (success 4); group 2: 1, 3 (success 1); group 3: 5 alone.
    assert demos == [4, None, 4, 1, None, None]
    for i, d in enumerate(demos):
        if d is not None:
            assert groups[d] == groups[i]


def test_select_demonstrations_rejects_mismatched_lengths_and_nan():
    with pytest.raises(ValueError, match="differ in length: 2 vs 1"):
        select_demonstrations([0.0, 1.0], [0], success_threshold=1.0, exclude_self=True)
    with pytest.raises(ValueError, match="finite"):
        select_demonstrations([float("nan")], [0], success_threshold=1.0, exclude_self=True)


# --------------------------------------------------------------------------- strip_thinking


def test_strip_thinking_removes_all_blocks_and_following_whitespace():
    text = "<think>plan A</think>\n\nStep 1. <think>check\nmore</think>  Answer: 4"
    assert strip_thinking(text) == "Step 1. Answer: 4"


def test_strip_thinking_without_tags_is_identity():
    assert strip_thinking("  Answer: {4}\n") == "  Answer: {4}\n"


def test_strip_thinking_unclosed_block_drops_the_rest():
    assert strip_thinking("Answer: 4\n<think>but wait, maybe") == "Answer: 4"
    assert strip_thinking("<think>never finished") == ""


def test_strip_thinking_orphan_close_drops_prefix_from_template_opened_reasoning():
    assert strip_thinking("reasoning here\n</think>\n\nAnswer: 4") == "Answer: 4"


# --------------------------------------------------------------------------- fit_demonstration


def test_fit_demonstration_no_limit_is_identity():
    assert fit_demonstration("x" * 1000, max_chars=None, overflow="error") == "x" * 1000


def test_fit_demonstration_truncates_text_keeping_head():
    assert fit_demonstration("abcdefghij", max_chars=4, overflow="truncate") == "abcd"
    assert fit_demonstration("abcd", max_chars=4, overflow="error") == "abcd"


def test_fit_demonstration_error_names_lengths():
    with pytest.raises(ValueError, match="10 characters, more than max_chars=4"):
        fit_demonstration("abcdefghij", max_chars=4, overflow="error")


def test_fit_demonstration_token_budget_by_binary_search():
    def count_words(text: str) -> int:
        return len(text.split())

    text = "one two three four five six"
    out = fit_demonstration(text, max_chars=None, overflow="truncate", count_tokens=count_words, max_tokens=3)
    assert count_words(out) <= 3
    # The longest prefix within budget: one more character would start a fourth word.
    assert out == "one two three "
    with pytest.raises(ValueError, match="6 tokens .* max_tokens=3"):
        fit_demonstration(text, max_chars=None, overflow="error", count_tokens=count_words, max_tokens=3)


def test_fit_demonstration_rejects_half_token_config():
    with pytest.raises(ValueError, match="go together"):
        fit_demonstration("abc", max_chars=None, overflow="truncate", max_tokens=3)


# --------------------------------------------------------------------------- templating


def test_default_templates_are_the_papers():
    assert SOLUTION_TEMPLATE == "\nCorrect solution:\n\n{successful_previous_attempt}"
    assert FEEDBACK_TEMPLATE == "\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback_raw}"
    assert REPROMPT_TEMPLATE == "{prompt}{solution}{feedback}\n\nCorrectly solve the original question."


def test_render_reprompt_closed_form_solution_and_feedback():
    out = render_reprompt("Q?", solution="S", feedback="F")
    assert out == (
        "Q?\nCorrect solution:\n\nS"
        "\nThe following is feedback from your unsuccessful earlier attempt:\n\nF"
        "\n\nCorrectly solve the original question."
    )


def test_render_reprompt_nothing_returns_prompt_unchanged():
    assert render_reprompt("Q {x}?", solution=None, feedback=None) == "Q {x}?"


def test_braces_in_prompt_demo_and_feedback_survive_verbatim():
    prompt = "Compute {a} + {{b}} where f(x) = {x: 1} and {prompt}"
    demo = "def f():\n    return {'k': {solution}}\n"
    feedback = "KeyError: '{feedback_raw}' in {0} {}"
    out = render_reprompt(prompt, solution=demo, feedback=feedback)
    assert out.startswith(prompt)
    assert demo in out and feedback in out
    # Inserted text is never re-scanned: its placeholder-like tokens appear exactly as given.
    assert out.count("{prompt}") == 1 and out.count("{solution}") == 1 and out.count("{feedback_raw}") == 1


def test_substitute_leaves_other_braces_alone():
    assert substitute("{a} {{b}} {c} {", {"a": "{c}"}) == "{c} {{b}} {c} {"


def test_custom_templates_are_checked_for_placeholders():
    check_template("<s>{successful_previous_attempt}</s>", required=("successful_previous_attempt",), what="t")
    with pytest.raises(ValueError, match=r"missing placeholders \['\{feedback\}'\]"):
        render_reprompt("Q", solution="S", feedback=None, reprompt_template="{prompt}{solution}")
    with pytest.raises(ValueError, match=r"unknown placeholders \['\{solutoin\}'\]"):
        render_reprompt("Q", solution="S", feedback=None, reprompt_template="{prompt}{solution}{feedback}{solutoin}")


def test_custom_templates_are_used():
    out = render_reprompt(
        "Q",
        solution="S",
        feedback=None,
        solution_template="[demo]{successful_previous_attempt}[/demo]",
        reprompt_template="{feedback}{solution}|{prompt}",
    )
    assert out == "[demo]S[/demo]|Q"


# --------------------------------------------------------------------------- message lists


def test_system_message_kept_and_privileged_text_in_last_user_message(chat):
    out = build_teacher_messages(chat, solution="4", feedback=None)
    assert out[0] == {"role": "system", "content": "You are precise."}
    assert [m["role"] for m in out] == ["system", "user"]
    assert out[1]["content"] == render_reprompt("What is 2+2?", solution="4", feedback=None)
    assert out[-1]["role"] == "user"


def test_multi_turn_only_last_user_message_changes():
    chat = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "reply"},
        {"role": "user", "content": "second"},
    ]
    out = build_teacher_messages(chat, solution=None, feedback="wrong")
    assert out[:3] == tuple(chat[:3])
    assert out[3]["content"].startswith("second\nThe following is feedback")


def test_nothing_privileged_returns_equal_copy(chat):
    out = build_teacher_messages(chat, solution=None, feedback=None)
    assert list(out) == chat
    assert all(a is not b for a, b in zip(out, chat, strict=True))


def test_no_user_message_raises(chat):
    with pytest.raises(ValueError, match="no user message.*'system'"):
        build_teacher_messages([chat[0]], solution="4", feedback=None)
    with pytest.raises(ValueError, match="no user message"):
        build_relax_teacher_messages([chat[0]], solution="4", feedback=None)


def test_non_text_content_raises():
    with pytest.raises(TypeError, match="text only"):
        build_teacher_messages([{"role": "user", "content": [{"type": "text"}]}], solution="4", feedback=None)


def test_input_messages_never_mutated(chat):
    before = copy.deepcopy(chat)
    out = build_teacher_messages(chat, solution="4", feedback="fb")
    relax = build_relax_teacher_messages(chat, solution="4", feedback=None)
    assert chat == before
    out[1]["content"] = "changed"
    relax[0]["content"] = "changed"
    assert chat == before


def test_relax_rendering_closed_form(chat):
    out = build_relax_teacher_messages(chat, solution="4", feedback="fb")
    assert out[0] == chat[0]
    assert out[1]["content"] == (
        "What is 2+2?\n\n<successful_attempt>\n4\n</successful_attempt>\n\n<feedback>\nfb\n</feedback>"
        "\n\nNow produce the best answer to the original problem."
    )
    assert build_relax_teacher_messages(chat, solution=None, feedback=None) == tuple(chat)


# --------------------------------------------------------------------------- environment feedback rules


@pytest.mark.parametrize(
    ("include", "only_without", "expected_with_solution", "expected_without_solution"),
    [
        (True, True, None, "fb"),
        (True, False, "fb", "fb"),
        (False, True, None, None),
        (False, False, None, None),
    ],
)
def test_environment_feedback_flags(include, only_without, expected_with_solution, expected_without_solution):
    kwargs = dict(include_environment_feedback=include, environment_feedback_only_without_solution=only_without)
    assert select_feedback("fb", has_solution=True, **kwargs) == expected_with_solution
    assert select_feedback("fb", has_solution=False, **kwargs) == expected_without_solution


@pytest.mark.parametrize("empty", [None, "", "  \n"])
def test_empty_feedback_is_no_feedback(empty):
    kwargs = dict(include_environment_feedback=True, environment_feedback_only_without_solution=False)
    assert select_feedback(empty, has_solution=False, **kwargs) is None
