"""The code verifier's pure parts: extraction, judging, feedback. Programs are not run here; a fake
runner stands in for the sandbox (tests/integration/test_sandbox.py runs real programs)."""

import json

import pytest

from sdpo_core.records import Verdict
from sdpo_core.verifiers.code import (
    FORMAT_ERROR,
    TRUNCATED,
    Execution,
    TestResult,
    TestSuite,
    extract_code,
    format_feedback,
    judge,
    parse_tests,
    stdout_matches,
    suite_to_label,
    value_matches,
    verify,
)

STDIN = TestSuite(testtype="stdin", inputs=["1 2\n", "10 20\n", "5 5\n"], outputs=["3\n", "30\n", "10\n"])


def fake_runner(*executions: Execution):
    calls = []

    def run(program: str, suite: TestSuite) -> list[Execution]:
        calls.append((program, suite))
        return list(executions)

    run.calls = calls  # type: ignore[attr-defined]
    return run


def ok(index: int, output: str, stderr: str = "") -> Execution:
    return Execution(index=index, status="ok", output=output, stderr=stderr)


# -- extraction ----------------------------------------------------------------------------------
def test_the_longest_fenced_block_is_the_program():
    text = (
        "Idea:\n```\nx = 1\n```\nSolution:\n```python\nimport sys\n"
        "print(sum(map(int, sys.stdin.read().split())))\n```\nDone."
    )
    assert extract_code(text) == "import sys\nprint(sum(map(int, sys.stdin.read().split())))\n"


def test_unclosed_or_missing_fences_give_no_program():
    assert extract_code("print(1)") is None
    assert extract_code("```python\nprint(1)\n") is None
    assert extract_code("```python\n   \n```") is None


def test_language_tags_and_inline_backticks_are_handled():
    assert extract_code("use `x` then\n```py3\nprint(2)\n```") == "print(2)\n"


# -- labels ---------------------------------------------------------------------------------------
def test_labels_round_trip():
    suite = TestSuite(testtype="functional", inputs=["[1]\n2"], outputs=["3"], fn_name="f", time_limit=2.0)
    assert parse_tests(suite_to_label(suite)) == suite


@pytest.mark.parametrize(
    ("label", "match"),
    [
        ('{"testtype": "stdin", "inputs": ["1"], "outputs": []}', "outputs"),
        ('{"testtype": "functional", "inputs": ["1"], "outputs": ["1"]}', "fn_name"),
        ('{"testtype": "shell", "inputs": ["1"], "outputs": ["1"]}', "testtype"),
        ('{"testtype": "stdin", "inputs": [], "outputs": []}', "at least one"),
        ('{"testtype": "assert", "inputs": ["assert 1"], "outputs": ["x"]}', "no outputs"),
        ('{"testtype": "stdin", "inputs": ["1"], "outputs": ["1"], "time_limit": 0}', "time_limit"),
        ('{"testtype": "stdin", "inputs": ["1"], "outputs": ["1"], "extra": 1}', "unknown keys"),
        ('["not", "an", "object"]', "JSON object"),
    ],
)
def test_malformed_labels_are_rejected(label, match):
    with pytest.raises((ValueError, TypeError), match=match):
        parse_tests(label)


# -- judging --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("actual", "expected", "same"),
    [
        ("3\n", "3", True),
        ("  3  \n\n", "3\n", True),
        ("1 2\n3\n", "1 2\n3", True),
        ("1  2", "1 2", True),
        ("0.3333333", "0.33333333", False),  # no tolerance in the label: numbers are exact
        ("0.33333333", "0.333333330", True),
        ("1e3", "1000", True),
        ("3", "4", False),
        ("1 2", "1\n2", False),
        ("YES", "yes", False),
        ("", "0", False),
        ("3.0001", "3", False),
    ],
)
def test_stdout_comparison(actual, expected, same):
    assert stdout_matches(actual, expected) is same


@pytest.mark.parametrize(
    ("actual", "expected", "same"),
    [
        ("[1, 2]", "[1,2]", True),
        ("3.0000000001", "3", False),  # no tolerance in the label: numbers are exact
        ("3.0", "3", True),
        ('{"a": 1}', '{"a": 1}', True),
        ("true", "1", False),
        ("[1, 2]", "[2, 1]", False),
        ("null", "0", False),
        ("not json", "1", False),
        ('"a"', "a", False),
    ],
)
def test_return_value_comparison(actual, expected, same):
    assert value_matches(actual, expected) is same


def test_judge_maps_sandbox_statuses_to_outcomes():
    executions = [
        ok(0, "3\n"),
        ok(1, "31\n"),
        Execution(index=2, status="error", error="ZeroDivisionError: division by zero"),
    ]
    results = judge(STDIN, executions)
    assert [r.outcome for r in results] == ["passed", "wrong_answer", "runtime_error"]
    assert results[1].expected == "30\n" and results[1].output == "31\n"


def test_judge_requires_one_execution_per_test_in_order():
    with pytest.raises(ValueError, match="in order"):
        judge(STDIN, [ok(0, "3"), ok(2, "10")])


def test_assert_tests_pass_without_outputs_and_fail_as_wrong_answers():
    suite = TestSuite(testtype="assert", inputs=["assert f(1) == 2", "assert f(2) == 4"], entry_points=["f"])
    results = judge(suite, [ok(0, ""), Execution(index=1, status="failed", error="AssertionError")])
    assert [r.outcome for r in results] == ["passed", "wrong_answer"]


# -- feedback -------------------------------------------------------------------------------------
def result(
    index: int,
    outcome: str,
    *,
    input: str = "1",
    output: str = "",
    expected: str | None = "x",
    error: str = "",
    stderr: str = "",
) -> TestResult:
    return TestResult(
        index=index, outcome=outcome, input=input, output=output, expected=expected, error=error, stderr=stderr
    )


def test_all_passed_gives_no_feedback():
    assert format_feedback([result(0, "passed"), result(1, "passed")]) is None


def test_runtime_error_comes_first_with_its_last_input():
    text = format_feedback(
        [
            result(0, "wrong_answer", input="2", output="5", expected="4"),
            result(1, "time_limit_exceeded", input="3"),
            result(2, "runtime_error", input="0", error="ZeroDivisionError: division by zero\nLine 3 in solve"),
        ]
    )
    assert text == "Runtime Error\nZeroDivisionError: division by zero\nLine 3 in solve\n\nLast Executed Input\n0"


def test_time_limit_comes_before_wrong_answers():
    text = format_feedback(
        [result(0, "wrong_answer", output="5", expected="4"), result(1, "time_limit_exceeded", input="9 9")]
    )
    assert text == "Time Limit Exceeded\n\nLast Executed Input\n9 9"


def test_wrong_answers_shortest_first_at_most_two():
    text = format_feedback(
        [
            result(0, "wrong_answer", input="1000000 2000000", output="1", expected="3000000"),
            result(1, "wrong_answer", input="1 2", output="4", expected="3"),
            result(2, "wrong_answer", input="10 20", output="31", expected="30"),
        ]
    )
    assert text.startswith(
        "Test Case 2: Wrong Answer\n\nInput\n1 2\n\nOutput\n4\n\nExpected\n3\n\nTest Case 3: Wrong Answer"
    )
    assert "Test Case 1" not in text


def test_fields_inputs_and_whole_text_are_cut():
    long_line = "9" * 1000
    many_lines = "\n".join(str(i) for i in range(20))
    text = format_feedback([result(0, "wrong_answer", input=many_lines, output=long_line, expected="1")])
    assert "9" * 250 + "..." in text and "9" * 251 not in text
    assert "\n7\n... (12 more lines)" in text and "\n8\n" not in text
    huge = format_feedback([result(0, "runtime_error", error="E\n" + ("x" * 249 + "\n") * 50)], max_input_lines=100)
    assert len(huge) == 2000


def test_stderr_is_shown_as_debug_output():
    text = format_feedback([result(0, "wrong_answer", output="1", expected="2", stderr="debug: n=1")])
    assert text.endswith("Stderr\ndebug: n=1")


def test_failed_assertion_shows_the_test_not_an_expected_output():
    text = format_feedback([result(0, "wrong_answer", input="assert f(2) == 4", expected=None, error="AssertionError")])
    assert text == "Test Case 1: Wrong Answer\n\nInput\nassert f(2) == 4\n\nFailure\nAssertionError"


# -- verify ---------------------------------------------------------------------------------------
PROGRAM = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"


def test_all_tests_passing_scores_one():
    run = fake_runner(ok(0, "3\n"), ok(1, "30\n"), ok(2, "10\n"))
    assert verify(PROGRAM, suite_to_label(STDIN), truncated=False, run_tests=run) == Verdict(reward=1.0)
    assert run.calls[0] == ("a, b = map(int, input().split())\nprint(a + b)\n", STDIN)


def test_one_failing_test_scores_zero_with_leetcode_feedback():
    run = fake_runner(ok(0, "3\n"), ok(1, "31\n"), ok(2, "10\n"))
    verdict = verify(PROGRAM, suite_to_label(STDIN), truncated=False, run_tests=run)
    assert verdict.reward == 0.0 and not verdict.format_error
    assert verdict.feedback == "Test Case 2: Wrong Answer\n\nInput\n10 20\n\nOutput\n31\n\nExpected\n30"


def test_partial_credit_is_the_fraction_passed():
    run = fake_runner(ok(0, "3\n"), ok(1, "31\n"), ok(2, "10\n"))
    verdict = verify(PROGRAM, suite_to_label(STDIN), truncated=False, run_tests=run, partial_credit=True)
    assert verdict.reward == pytest.approx(2 / 3)


def test_no_code_block_is_a_format_error_and_runs_nothing():
    run = fake_runner()
    verdict = verify("print(1)", suite_to_label(STDIN), truncated=False, run_tests=run)
    assert verdict == Verdict(reward=0.0, feedback=FORMAT_ERROR, format_error=True)
    assert run.calls == []


def test_truncated_responses_score_zero_and_run_nothing():
    run = fake_runner()
    assert verify(PROGRAM, suite_to_label(STDIN), truncated=True, run_tests=run) == Verdict(
        reward=0.0, feedback=TRUNCATED, truncated=True
    )
    assert run.calls == []


def test_feedback_for_format_and_truncation_shows_no_test_data():
    for verdict in (
        verify("x", suite_to_label(STDIN), truncated=False, run_tests=fake_runner()),
        verify(PROGRAM, suite_to_label(STDIN), truncated=True, run_tests=fake_runner()),
    ):
        assert "30" not in verdict.feedback and "10 20" not in verdict.feedback


def test_the_runner_is_required():
    with pytest.raises(ValueError, match="run_tests"):
        verify(PROGRAM, suite_to_label(STDIN), truncated=False)


def test_functional_labels_from_livecodebench_are_judged_as_json():
    suite = TestSuite(testtype="functional", inputs=["[1, 2, 3]\n4"], outputs=["1"], fn_name="countPairs")
    run = fake_runner(ok(0, "1"))
    assert verify(PROGRAM, json.dumps(json.loads(suite_to_label(suite))), truncated=False, run_tests=run).reward == 1.0


def test_execution_rejects_unknown_statuses():
    with pytest.raises(ValueError, match="status"):
        Execution(index=0, status="passed")


# -- exact integers, ASCII digits, any output judged ---------------------------------------------
@pytest.mark.parametrize(
    ("actual", "expected"),
    [
        ("1000000008", "1000000007"),  # a*b % (10**9 + 7) + 1: one off a competitive-programming answer
        ("10000010", "10000000"),
        ("-1000001", "-1000000"),
        ("9" * 5000, "9" * 4999 + "8"),  # both beyond a float's range
        ("1e400", "2e400"),
        ("٤٢", "42"),  # Arabic-Indic digits
        ("４２", "42"),  # fullwidth digits
        ("4\u20032", "4 2"),  # an em space is not a token separator
    ],
)
def test_integer_tokens_compare_exactly_and_only_in_ascii(actual, expected):
    assert stdout_matches(actual, expected) is False


@pytest.mark.parametrize(
    ("actual", "expected"),
    [
        ("1000000007", "1000000007"),
        ("+7", "7"),
        ("007", "7"),
        ("-0", "0"),
        ("1000000007.0", "1000000007"),  # a float token that denotes exactly the integer
        ("1e9", "1000000000"),
        ("9" * 5000, "9" * 5000),
        ("3\r\n4\r\n", "3\n4"),
    ],
)
def test_equal_numbers_still_match(actual, expected):
    assert stdout_matches(actual, expected) is True


@pytest.mark.parametrize(
    ("actual", "expected", "same"),
    [
        ("1000001", "1000000", False),
        ("[10000010]", "[10000000]", False),
        ("1000000.0000001", "1000000", False),  # a float on one side: still exact
        ("1000000.000000", "1000000", True),
        ("1" + "0" * 400, "5", False),  # an int beyond a float's range
        ("1" + "0" * 400, "5.0", False),
        ("1" + "0" * 400, "1" + "0" * 400, True),
        ("7" * 10_000, "7" * 10_000, True),  # past the int string limit: ValueError in json.loads
        ("7" * 10_000, "7" * 9_999 + "6", False),
        ("[" * 100_000 + "]" * 100_000, "[]", False),  # RecursionError in json.loads
        ("[" * 900 + "]" * 900, "[" * 900 + "]" * 900, False),  # nested past any real answer
        ("NaN", "1", False),
        ("1e400", "2e400", False),  # beyond a float's range: exact decimals
        ("1e400", "10e399", True),
        ("Infinity", "1e999", False),
        ("Infinity", "Infinity", True),
    ],
)
def test_return_values_compare_ints_exactly_and_never_raise(actual, expected, same):
    assert value_matches(actual, expected) is same


@pytest.mark.parametrize(
    "output",
    [
        "1" + "0" * 400,
        "-" + "9" * 100_000,
        "[" * 100_000,
        "[" * 50_000 + "]" * 50_000,
        '{"a": ' * 10_000 + "1" + "}" * 10_000,
        "\x00\x01\x1c\x1d\x1e\x85" * 100_000,
        "1e999999",
    ],
)
def test_any_return_value_or_output_gets_a_verdict(output):
    functional = TestSuite(testtype="functional", inputs=["1", "2"], outputs=["5", "5.0"], fn_name="f")
    stdin = TestSuite(testtype="stdin", inputs=["1", "2"], outputs=["5", "5.0"])
    for suite in (functional, stdin):
        run = fake_runner(ok(0, output), ok(1, output))
        verdict = verify(PROGRAM, suite_to_label(suite), truncated=False, run_tests=run)
        assert verdict.reward == 0.0 and verdict.feedback.startswith("Test Case 1: Wrong Answer")
