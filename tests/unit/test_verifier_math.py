import time

import pytest

from sdpo_core.records import Verdict
from sdpo_core.verifiers.math import (
    FORMAT_ERROR,
    TRUNCATED,
    answers_match,
    extract_final_answer,
    normalise,
    to_number,
    verify,
)


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("so \\boxed{42}", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("first \\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{\\boxed{7}}", "7"),  # the innermost of nested boxes
        ("\\boxed{ {a}^{2} }", "{a}^{2}"),
        ("\\fbox{3}", "3"),
        ("\\boxed 5 apples", "5"),
        ("3*4=12\n#### 12", "12"),
        ("#### 1\nrethink\n#### 2", "2"),
        ("\\boxed{3} and then #### 4", "3"),  # a box wins over the GSM8K marker
    ],
)
def test_final_answer_extraction(response, expected):
    assert extract_final_answer(response) == expected


@pytest.mark.parametrize("response", ["the answer is 42", "", "\\boxed{", "\\boxed{}", "####   "])
def test_no_recognised_final_answer(response):
    assert extract_final_answer(response) is None


def test_last_number_fallback_only_when_allowed():
    assert extract_final_answer("so it is 1,234.5 in total") is None
    assert extract_final_answer("so it is 1,234.5 in total", allow_last_number=True) == "1,234.5"


@pytest.mark.parametrize(
    ("answer", "label"),
    [
        ("42", "42"),
        ("042", "42"),
        ("42.0", "42"),
        ("1,000", "1000"),
        ("1,234,567", "1234567"),
        ("\\frac{1}{2}", "0.5"),
        ("\\dfrac{3}{4}", "3/4"),
        ("\\frac34", "0.75"),
        ("-\\frac{1}{3}", "-1/3"),
        ("\\frac{-1}{3}", "-1/3"),
        ("1e3", "1000"),
        ("50\\%", "50"),
        ("\\$18", "18"),
        ("18 dollars", "18"),
        ("12 \\text{ cm}", "12"),
        ("90^\\circ", "90"),
        ("x = 3", "3"),
        ("(1, 2)", "(1,2)"),
        ("2\\sqrt{2}", "\\sqrt{8}"),
        ("\\sqrt[3]{8}", "2"),
        ("x^2+2x+1", "(x+1)^2"),
        ("\\frac{\\pi}{2}", "\\pi/2"),
        ("\\left( 3 \\right)", "3"),
        ("\\text{Tuesday}", "tuesday"),
    ],
)
def test_equal_answers_match(answer, label):
    assert answers_match(answer, label)
    assert verify(f"... \\boxed{{{answer}}}", label, truncated=False) == Verdict(reward=1.0)


@pytest.mark.parametrize(
    ("answer", "label"),
    [
        ("41", "42"),
        ("0.3333", "1/3"),
        ("\\frac{1}{3}", "0.33"),
        ("(2, 1)", "(1, 2)"),
        ("x^2", "x^3"),
        ("-5", "5"),
        ("1,000", "100"),
        ("\\sqrt{2}", "2"),
        ("Monday", "Tuesday"),
    ],
)
def test_different_answers_do_not_match(answer, label):
    assert not answers_match(answer, label)


def test_gsm8k_solution_labels_use_their_final_answer():
    label = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n48+24 = <<48+24=72>>72\n#### 72"
    assert verify("She sold 72 clips.\n#### 72", label, truncated=False).reward == 1.0
    assert normalise(label) == "72"


def test_wrong_answer_feedback_shows_the_answer_but_not_the_label():
    verdict = verify("\\boxed{41}", "42", truncated=False)
    assert verdict == Verdict(reward=0.0, feedback="Your final answer 41 is not correct.")
    revealed = verify("\\boxed{41}", "42", truncated=False, reveal_answer=True)
    assert revealed.feedback.endswith("Expected: 42.")


def test_missing_final_answer_is_a_format_error():
    assert verify("it is 42", "42", truncated=False) == Verdict(reward=0.0, feedback=FORMAT_ERROR, format_error=True)
    assert verify("it is 42", "42", truncated=False, allow_last_number=True).reward == 1.0


def test_truncation_takes_priority():
    assert verify("\\boxed{42}", "42", truncated=True) == Verdict(reward=0.0, feedback=TRUNCATED, truncated=True)


def test_empty_label_is_rejected():
    with pytest.raises(ValueError, match="empty"):
        verify("\\boxed{1}", "  ", truncated=False)


@pytest.mark.parametrize(
    "answer",
    [
        "9^9^9^9",
        "2^{1000000}",
        "(2^9)^{9^9}",
        "__import__('os').system('true')",
        "eval(1)",
        "x.__class__",
        "lambda: 1",
        "[i for i in range(10**9)]",
        "\\frac{1}{0}",
    ],
)
def test_adversarial_answers_are_rejected_quickly_and_never_evaluated(answer):
    started = time.monotonic()
    assert verify(f"\\boxed{{{answer}}}", "1", truncated=False).reward == 0.0
    assert time.monotonic() - started < 5.0


def test_unbalanced_braces_in_a_box_are_a_format_error():
    assert verify("\\boxed{\\frac{1}{2}", "0.5", truncated=False).format_error


def test_to_number_is_exact():
    assert to_number("0.1") * 3 == to_number("0.3")
    assert to_number("\\frac{2}{6}") == to_number("1/3")
    assert to_number("1/0") is None
    assert to_number("abc") is None
