"""Every verifier on adversarial answers: no exception but a label error, no call over its time bound.

The named inputs are the ones that stalled or crashed the verifiers before they were bounded; the
fuzz test (hypothesis) mixes their building blocks at random. `MAX_CALL_S` (CPU seconds) is far
above what a bounded verifier needs (milliseconds) and far below what the unbounded ones took (14 s
to never)."""

from __future__ import annotations

import gc
import json
import time
from functools import partial

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sdpo_core.records import Verdict
from sdpo_core.verifiers import arithmetic, code, math, mcq, tooluse
from sdpo_core.verifiers.code import Execution, TestSuite, suite_to_label

MAX_CALL_S = 1.0
REACT_LABEL = json.dumps([{"Action": "search", "Action_Input": '{"q": "x"}'}])
CALLS_LABEL = json.dumps({"ground_truth": [{"f": {"x": [1]}}], "functions": [{"name": "f", "parameters": {}}]})
CODE_LABEL = suite_to_label(TestSuite(testtype="stdin", inputs=["1\n"], outputs=["1\n"]))


def _no_run(program: str, suite: TestSuite) -> list[Execution]:
    return [Execution(index=i, status="ok", output=program[:100]) for i in range(len(suite.inputs))]


VERIFIERS = {
    "arithmetic": lambda text: arithmetic.verify(text, "42", truncated=False),
    "mcq": lambda text: mcq.verify(text, "B", truncated=False),
    "math": lambda text: math.verify(text, "42", truncated=False),
    "math (solution label)": lambda text: math.verify(text, "so 6*7 = 42\n#### 42", truncated=False),
    "tooluse": lambda text: tooluse.verify(text, REACT_LABEL, truncated=False, detailed_feedback=True),
    "function_call": lambda text: tooluse.verify_function_calls(text, CALLS_LABEL, truncated=False),
    "code (judging only)": lambda text: code.verify(text, CODE_LABEL, truncated=False, run_tests=_no_run),
}

HOSTILE = {
    "unclosed boxed, repeated": "\\boxed{" * 20_000,
    "boxed 1e10000000": "\\boxed{1e10000000}",
    "boxed 1e999999999": "\\boxed{1e999999999}",
    "boxed 5000 digits": "\\boxed{" + "9" * 5_000 + "}",
    "boxed a fraction of huge numbers": "\\boxed{\\frac{" + "7" * 5_000 + "}{3}}",
    "gsm8k marker and a huge number": "#### " + "1" * 100_000,
    "huge number with an exponent for sympy": "\\boxed{2^{" + "9" * 60 + "}}",
    "deep parentheses": "\\boxed{" + "(" * 5_000 + "1" + ")" * 5_000 + "}",
    "repeated Action lines": "Action: search\n" * 4_000,
    "Action on one long line": "Action: x " * 20_000,
    "deeply nested Action Input": "Action: search\nAction Input: " + "[" * 100_000,
    "deeply nested closed Action Input": 'Action: search\nAction Input: {"q": ' + "[" * 50_000 + "]" * 50_000 + "}",
    "deeply nested JSON calls": "[" * 100_000,
    "deeply nested arguments text": '{"name": "f", "arguments": "' + "[" * 20_000 + '"}',
    "nested Python calls": "f(" * 10_000,
    "digits then garbage": "1" * 100_000 + "x",
    "a huge final integer": "1" * 10_000,
    "many answer tags": "<answer>" * 50_000,
    "unclosed fences": "```python\n" * 20_000,
    "Arabic-Indic 42": "\\boxed{٤٢}",
    "fullwidth 42": "\\boxed{４２}",
    "a closing brace before an opening one (sympy's parser IndexError)": "#### }\\sqrt{",
}


def timed(verify, text: str) -> Verdict:
    gc.disable()  # a collection of the whole test session's heap is not the verifier's work
    try:
        started = time.thread_time()  # CPU time of this thread: other processes and threads do not count
        verdict = verify(text)
        elapsed = time.thread_time() - started
    finally:
        gc.enable()
    assert elapsed < MAX_CALL_S, f"{elapsed:.2f} s"
    assert isinstance(verdict, Verdict) and 0.0 <= verdict.reward <= 1.0
    return verdict


@pytest.mark.parametrize("name", list(VERIFIERS))
@pytest.mark.parametrize("attack", list(HOSTILE), ids=list(HOSTILE))
def test_a_hostile_answer_is_judged_quickly_and_scores_zero(name, attack):
    verdict = timed(VERIFIERS[name], HOSTILE[attack])
    if name != "code (judging only)":  # the stand-in runner echoes the program: not a real judgement
        assert verdict.reward == 0.0


def test_non_ascii_digits_are_not_numbers():
    assert math.verify("\\boxed{42}", "42", truncated=False).reward == 1.0
    for digits in ("٤٢", "４２", "۴۲"):
        assert math.verify(f"\\boxed{{{digits}}}", "42", truncated=False).reward == 0.0
        assert arithmetic.final_answer(f"the answer is {digits}") is None
    assert math.to_number("٤٢") is None


def test_bounded_numbers_still_compare_exactly():
    assert math.verify("\\boxed{1e3}", "1000", truncated=False).reward == 1.0
    assert math.verify("\\boxed{" + "9" * 900 + "}", "9" * 900, truncated=False).reward == 1.0
    assert math.to_number("1e1001") is None and math.to_number("1" * 1001) is None
    assert arithmetic.final_answer("x = " + "7" * 1000) == int("7" * 1000)
    assert arithmetic.final_answer("x = " + "7" * 1001) is None


def test_nesting_is_a_format_error_that_says_so():
    verdict = tooluse.verify("Action: search\nAction Input: " + "[" * 100_000, REACT_LABEL, truncated=False)
    assert verdict.format_error and "deeper than 32 levels" in verdict.feedback
    verdict = tooluse.verify_function_calls("[" * 100_000, CALLS_LABEL, truncated=False)
    assert verdict.format_error and "deeper than 32 levels" in verdict.feedback


def test_the_react_parser_is_linear():
    """Doubling the input must not quadruple the time (the old parser copied the rest per step)."""

    def seconds(n):
        text = "Thought: go\nAction: search\n" * n + 'Action Input: {"q": "x"}\n' * n
        best = float("inf")
        gc.disable()  # a collection of the whole test session's heap is not the parser's work
        try:
            for _ in range(3):  # the least of three: a preempted or cache-cold call is not the parser either
                started = time.thread_time()
                tooluse.parse_react_steps(text)
                best = min(best, time.thread_time() - started)
        finally:
            gc.enable()
        return best

    small, large = seconds(2_000), seconds(8_000)
    assert large < 8 * small + 0.05, (small, large)  # 4x the input: about 4x the time, never 16x


PIECES = st.sampled_from(
    [
        "\\boxed{",
        "}",
        "{",
        "\\frac",
        "####",
        "Action:",
        "Action Input:",
        "\n",
        "[",
        "]",
        "(",
        ")",
        '"',
        ":",
        ",",
        "<answer>",
        "</answer>",
        "```",
        "```python\n",
        "e",
        "E",
        "^",
        "9" * 50,
        "1",
        "-",
        ".",
        "x",
        "f(",
        "=",
        "٤",
        "４",
        '{"name": "f", "arguments": ',
        "sqrt",
        "\\sqrt{",
        "pi",
        " ",
        "%",
    ]
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(PIECES, max_size=400), repeat=st.integers(min_value=1, max_value=50))
@pytest.mark.parametrize("name", list(VERIFIERS))
def test_fuzz_every_verifier_stays_within_its_time_bound(name, pieces, repeat):
    timed(VERIFIERS[name], "".join(pieces) * repeat)


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=2_000))
@pytest.mark.parametrize("name", list(VERIFIERS))
def test_fuzz_every_verifier_on_arbitrary_text(name, text):
    timed(VERIFIERS[name], text)


FUNCTIONAL_SUITE = TestSuite(testtype="functional", inputs=["1"], outputs=['[1000000007, 2.5, "x"]'], fn_name="f")
STDIN_SUITE = TestSuite(testtype="stdin", inputs=["1"], outputs=["1000000007 2.5\nx"])
OUTPUT_PIECES = st.sampled_from(
    '[ ] { } , : " . e E400 - + 1 2.5 1000000007 NaN Infinity null true ٤'.split(" ")
    + [" ", "\n", "\x00", "\x1c", "\u2028", "0" * 50, "9" * 500]
)


PASS = "```python\npass\n```"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(OUTPUT_PIECES, max_size=300), repeat=st.integers(min_value=1, max_value=200))
@example(pieces=["9" * 500], repeat=10)  # past the int string limit: json.loads raised ValueError
@example(pieces=["["], repeat=200)
def test_fuzz_any_output_or_return_value_is_judged_quickly(pieces, repeat):
    """Whatever a program prints or returns, judging it gives a verdict within the time bound."""
    output = "".join(pieces) * repeat

    def run(program: str, suite: TestSuite) -> list[Execution]:
        return [Execution(index=0, status="ok", output=output)]

    for label in (suite_to_label(FUNCTIONAL_SUITE), suite_to_label(STDIN_SUITE)):
        verdict = timed(partial(code.verify, label=label, truncated=False, run_tests=run), PASS)
        assert verdict.reward in (0.0, 1.0) and not verdict.format_error


BAD_LABELS = {"arithmetic": "x", "mcq": "Z", "math": "  ", "tooluse": "[1", "function_call": "{}"}


@pytest.mark.parametrize("name", list(BAD_LABELS))
def test_a_truncated_call_reads_the_label_and_nothing_else(name):
    """The contract the rollout's verifier worker relies on to tell a malformed label (raised) from a
    bug on one answer (that answer scores 0): with truncated=True a verifier reads its label, raising
    on a malformed one, and returns the truncation verdict without reading the answer."""
    from sdpo_core.verifiers import VERIFIERS

    with pytest.raises((ValueError, TypeError, KeyError)):
        VERIFIERS[name]("", BAD_LABELS[name], truncated=True)
    good = {"arithmetic": "42", "mcq": "B", "math": "42", "tooluse": REACT_LABEL, "function_call": CALLS_LABEL}[name]
    verdict = VERIFIERS[name](object(), good, truncated=True)  # an answer that cannot even be read
    assert verdict.truncated and verdict.reward == 0.0
