import pytest

from sdpo_core.records import Verdict
from sdpo_core.verifiers import VERIFIERS
from sdpo_core.verifiers.arithmetic import final_answer, verify


def test_correct_answer_scores_one_without_feedback():
    assert verify("82", "82", truncated=False) == Verdict(reward=1.0)


@pytest.mark.parametrize("text", [" 82", "82\n", "\n 82 \n", "82.", "The sum is 82.", "37+45=82"])
def test_surrounding_whitespace_and_prose_are_ignored(text):
    assert verify(text, "82", truncated=False).reward == 1.0


def test_wrong_answer_feedback_shows_output_and_expected():
    verdict = verify("83", "82", truncated=False)
    assert verdict.reward == 0.0
    assert verdict.feedback == "Wrong answer. Your output: 83. Expected: 82."
    assert not verdict.format_error and not verdict.truncated


def test_only_the_final_integer_counts():
    verdict = verify("82 or maybe 81", "82", truncated=False)
    assert verdict.reward == 0.0
    assert "Your output: 81." in verdict.feedback


@pytest.mark.parametrize("text", ["", "   ", "eighty-two", "82 is it", "8a"])
def test_non_numeric_ending_is_a_format_error_without_the_answer(text):
    verdict = verify(text, "82", truncated=False)
    assert verdict.reward == 0.0
    assert verdict.format_error and not verdict.truncated
    assert verdict.feedback.startswith("Format error")
    assert "Expected" not in verdict.feedback


def test_format_feedback_quotes_the_end_of_the_response():
    verdict = verify("abc", "5", truncated=False)
    assert "'abc'" in verdict.feedback
    assert "empty" in verify("", "5", truncated=False).feedback


def test_truncated_response_scores_zero_even_if_it_ends_with_the_label():
    verdict = verify("82", "82", truncated=True)
    assert verdict == Verdict(reward=0.0, feedback=verdict.feedback, truncated=True)
    assert verdict.feedback.startswith("Truncated")


def test_leading_zeros_are_accepted_and_signs_honoured():
    assert verify("082", "82", truncated=False).reward == 1.0
    assert verify("0", "0", truncated=False).reward == 1.0
    assert verify("-82", "82", truncated=False).reward == 0.0
    assert verify("-3", "-3", truncated=False).reward == 1.0


def test_expected_value_in_feedback_keeps_the_label_as_written():
    # a zero-padded label is the expected form of the answer, so the feedback shows it padded
    assert verify("7", "082", truncated=False).feedback.endswith("Expected: 082.")
    assert verify("7", " 82 ", truncated=False).feedback.endswith("Expected: 82.")


def test_non_integer_label_is_rejected():
    with pytest.raises(ValueError, match="label must be an integer"):
        verify("1", "one", truncated=False)


def test_final_answer_reads_the_trailing_integer():
    assert final_answer("12+3=15") == 15
    assert final_answer("15 ") == 15
    assert final_answer("15!") is None


def test_registry_names_the_arithmetic_verifier():
    assert VERIFIERS["arithmetic"] is verify
