import pytest

from sdpo_core.records import Verdict
from sdpo_core.verifiers.mcq import FORMAT_ERROR, MULTIPLE_OPTIONS, TRUNCATED, extract_answer, parse_choice, verify


@pytest.mark.parametrize(
    "response",
    [
        "<answer>B</answer>",
        "<reasoning>Gravity pulls down.</reasoning>\n<answer>\nB\n</answer>",
        "<answer> (B) </answer>",
        "<answer>[B]</answer>",
        "<answer>B.</answer>",
        "<answer>B)</answer>",
        "<answer>b</answer>",
        "<answer>**B**</answer>",
        "<answer>B: 9.8 m/s^2 downward</answer>",
        "<answer>(B) 9.8 m/s^2 downward, not option D</answer>",
        "<answer>The answer is B</answer>",
        "<ANSWER>B</ANSWER>",
        "<answer>Answer: B</answer>",
    ],
)
def test_correct_letter_in_any_common_form_scores_one(response):
    assert verify(response, "B", truncated=False) == Verdict(reward=1.0)


@pytest.mark.parametrize(
    "response", ["<answer>A</answer>", "<answer>C: something</answer>", "<answer>I pick D</answer>"]
)
def test_wrong_letter_scores_zero_without_feedback(response):
    assert verify(response, "B", truncated=False) == Verdict(reward=0.0)


def test_only_the_last_answer_tag_counts():
    assert verify("<answer>A</answer> wait, no. <answer>B</answer>", "B", truncated=False).reward == 1.0
    assert verify("<answer>B</answer> wait, no. <answer>A</answer>", "B", truncated=False).reward == 0.0


def test_nested_tags_take_the_innermost_last_opening():
    assert extract_answer("<answer>A <answer>B</answer></answer>") == "B"
    assert verify("<answer>A <answer>B</answer></answer>", "B", truncated=False).reward == 1.0


def test_an_unclosed_last_tag_is_a_format_error_even_after_a_closed_one():
    verdict = verify("<answer>B</answer> and finally <answer>C", "B", truncated=False)
    assert verdict == Verdict(reward=0.0, feedback=FORMAT_ERROR, format_error=True)


@pytest.mark.parametrize(
    "response",
    [
        "",
        "B",
        "The answer is B.",
        "<answer></answer>",
        "<answer>   </answer>",
        "<answer>none of them</answer>",
        "</answer>B<answer>",
        "<answer>E</answer>",
        "<answer>the first one</answer>",
    ],
)
def test_missing_or_empty_answers_are_format_errors(response):
    verdict = verify(response, "B", truncated=False)
    assert verdict.reward == 0.0 and verdict.format_error and verdict.feedback == FORMAT_ERROR


@pytest.mark.parametrize(
    "response", ["<answer>A or B</answer>", "<answer>B and C</answer>", "<answer>A, B, C, D</answer>"]
)
def test_hedging_between_options_is_a_format_error(response):
    assert verify(response, "B", truncated=False) == Verdict(reward=0.0, feedback=MULTIPLE_OPTIONS, format_error=True)


def test_truncation_takes_priority_over_a_correct_answer():
    verdict = verify("<answer>B</answer>", "B", truncated=True)
    assert verdict == Verdict(reward=0.0, feedback=TRUNCATED, truncated=True)


@pytest.mark.parametrize("label", ["A", "B", "C", "D"])
@pytest.mark.parametrize("response", ["<answer>A</answer>", "no tag", "<answer>A or C</answer>", "<answer>B"])
def test_feedback_never_depends_on_or_reveals_the_gold_letter(response, label):
    verdict = verify(response, label, truncated=False)
    reference = verify(response, "A", truncated=False)
    assert verdict.feedback == reference.feedback or verdict.reward != reference.reward
    assert verdict.feedback is None or verdict.feedback in (FORMAT_ERROR, MULTIPLE_OPTIONS)


def test_five_option_questions_need_the_letters_given():
    assert verify("<answer>E</answer>", "E", truncated=False, letters="ABCDE").reward == 1.0
    with pytest.raises(ValueError, match="option letters"):
        verify("<answer>E</answer>", "E", truncated=False)


@pytest.mark.parametrize("label", ["", "AB", "b", "Z", "1"])
def test_a_label_that_is_not_an_option_letter_is_rejected(label):
    with pytest.raises(ValueError, match="label"):
        verify("<answer>A</answer>", label, truncated=False)


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        ("<answer>True</answer>", "True", 1.0),
        ("<answer>false.</answer>", "False", 1.0),
        ("<answer>Yes</answer>", "True", 1.0),
        ("<answer>no</answer>", "True", 0.0),
        ("<answer>TRUE</answer>", "False", 0.0),
    ],
)
def test_true_false_labels_compare_words(response, label, reward):
    assert verify(response, label, truncated=False).reward == reward


def test_true_false_with_a_letter_is_a_format_error():
    assert verify("<answer>A</answer>", "True", truncated=False).format_error


def test_parse_choice_reports_several_options_as_a_tuple():
    assert parse_choice("A or C", letters="ABCD") == ("A", "C")
    assert parse_choice("I think so", letters="ABCD") is None  # "I" is not an option letter here
    assert parse_choice("B: Vitamin D", letters="ABCD") == "B"  # the leading letter wins over the option text


def test_huge_adversarial_input_is_handled_quickly():
    text = "<answer>" * 20_000 + "B" + "</answer>" * 20_000
    assert verify(text, "B", truncated=False).reward == 1.0
