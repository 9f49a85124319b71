"""Verifier for code answers: extraction, judging of test executions, LeetCode-style feedback.

This module is pure: it never runs the program. `verify` takes a `run_tests` callable (the
sandbox, `tasks.sandbox.program.runner(...)`) that executes the extracted program against a `TestSuite`
and returns one raw `Execution` per test; this module judges those executions against the
expected outputs (which therefore never enter the sandbox) and writes the feedback.

Label: JSON text `{"testtype": "stdin"|"functional"|"assert", "inputs": [...], "outputs": [...],
"fn_name": str|null, "time_limit": seconds|null, "setup": str, "entry_points": [str, ...],
"tolerance": {"abs": x, "rel": y}|absent}`:
- `stdin`: each input is fed to the program's standard input; its standard output must match the
  expected output line by line (`code_outputs.stdout_matches`: numbers by their exact decimal
  value whatever the program printed, ASCII digits only).
- `functional` (LiveCodeBench's call-based tests): each input holds one JSON value per line, the
  positional arguments of `fn_name` (a method of `class Solution` when the program defines one);
  the return value must equal the expected JSON value (`code_outputs.value_matches`, numbers as
  above, an int and a float alike).
- `tolerance` (stdin and functional only): the label says its answers are real-valued, and a number
  within max(abs, rel * |expected|) of the expected one passes. Without it, every number must be
  exact: the expected value decides what counts, never the program's choice of int or float.
- `assert` (HumanEval / MBPP): each input is Python test code, run after `setup` in a namespace that
  takes from the program only `entry_points` (the sandbox's judge runs it; the program's functions
  are called across a process boundary); the test passes when it raises nothing. `outputs` is
  empty.

Feedback follows the judge of the paper's code tasks: the first runtime error (message and last
executed input), else the first time-limit overrun, else up to `max_cases` wrong answers, shortest
first, each with input / output / expected. Fields are cut at 250 characters, inputs at 8 lines,
the whole text at 2000 characters. A wrong answer shows the expected output of that test case, as a
judge does; a format error or a truncated response shows nothing of the tests.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from keyword import iskeyword
from typing import Any, Literal, get_args

from sdpo_core.records import Verdict
from sdpo_core.verifiers.code_outputs import Tolerance, parse_tolerance, stdout_matches, value_matches

__all__ = [
    "EXEC_STATUSES",
    "FORMAT_ERROR",
    "TRUNCATED",
    "Execution",
    "TestResult",
    "TestRunner",
    "TestSuite",
    "Tolerance",
    "extract_code",
    "format_feedback",
    "judge",
    "parse_tests",
    "stdout_matches",
    "suite_to_label",
    "value_matches",
    "verify",
]

TestType = Literal["stdin", "functional", "assert"]
TEST_TYPES: tuple[str, ...] = get_args(TestType)
ExecStatus = Literal["ok", "failed", "error", "timeout", "not_run"]
"""What the sandbox saw: ran to the end / an assert-type test's assertion failed / raised or crashed /
hit a time limit / never started (an earlier test stopped the run)."""
EXEC_STATUSES: tuple[str, ...] = get_args(ExecStatus)
Outcome = Literal["passed", "wrong_answer", "runtime_error", "time_limit_exceeded", "not_run"]

FORMAT_ERROR = "Incorrect Format: put your complete program inside a ```python ... ``` block."
TRUNCATED = (
    "Truncated Attempt: the response hit the length limit before it ended. "
    "Write a shorter response with the complete program in one ```python ... ``` block."
)

_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)


@dataclass(frozen=True, kw_only=True)
class TestSuite:
    """The tests of one problem, parsed from its label."""

    __test__ = False  # not a pytest test class, despite the name

    testtype: TestType
    inputs: tuple[str, ...]
    outputs: tuple[str, ...] = ()
    fn_name: str | None = None
    time_limit: float | None = None
    setup: str = ""
    entry_points: tuple[str, ...] = ()
    tolerance: Tolerance | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        object.__setattr__(self, "entry_points", tuple(self.entry_points))
        if self.testtype not in TEST_TYPES:
            raise ValueError(f"testtype must be one of {TEST_TYPES}, got {self.testtype!r}")
        if not self.inputs:
            raise ValueError("a test suite needs at least one test input")
        if not all(isinstance(x, str) for x in self.inputs + self.outputs):
            raise TypeError("test inputs and outputs must be strings")
        if self.testtype == "assert":
            if self.outputs:
                raise ValueError(f"assert tests carry no outputs, got {len(self.outputs)}")
            if not self.entry_points:
                raise ValueError(
                    "assert tests need entry_points, the names the tests take from the program "
                    "(labels prepared before they existed: prepare the data again)"
                )
            names = [n for n in self.entry_points if isinstance(n, str) and n.isidentifier() and not iskeyword(n)]
            if len(set(names)) != len(self.entry_points):
                raise ValueError(f"entry_points must be distinct Python names, got {list(self.entry_points)}")
        elif self.entry_points:
            raise ValueError(f"only assert tests take entry_points, got {list(self.entry_points)} for {self.testtype}")
        elif len(self.outputs) != len(self.inputs):
            raise ValueError(f"{len(self.inputs)} test inputs but {len(self.outputs)} outputs")
        if self.testtype == "functional" and not self.fn_name:
            raise ValueError("functional tests need fn_name")
        if self.time_limit is not None and not self.time_limit > 0:
            raise ValueError(f"time_limit must be > 0 seconds, got {self.time_limit}")
        if self.tolerance is not None and self.testtype == "assert":
            raise ValueError("assert tests carry no tolerance: their test code compares the values itself")


@dataclass(frozen=True, kw_only=True)
class Execution:
    """One test as the sandbox ran it, before judging.

    `output` is the program's standard output (stdin tests) or the JSON text of the return value
    (functional tests); `error` the exception summary, crash or limit message; `stderr` whatever
    else the program printed (shown as debug output).
    """

    index: int
    status: ExecStatus
    output: str = ""
    error: str = ""
    stderr: str = ""

    def __post_init__(self) -> None:
        if self.status not in EXEC_STATUSES:
            raise ValueError(f"Execution.status must be one of {EXEC_STATUSES}, got {self.status!r}")


@dataclass(frozen=True, kw_only=True)
class TestResult:
    """One judged test."""

    __test__ = False  # not a pytest test class, despite the name

    index: int
    outcome: Outcome
    input: str
    output: str = ""
    expected: str | None = None
    error: str = ""
    stderr: str = ""

    @property
    def passed(self) -> bool:
        return self.outcome == "passed"


TestRunner = Callable[[str, TestSuite], Sequence[Execution]]
"""(program source, tests) -> one Execution per test, in order (tasks.sandbox.program.runner builds one)."""


def parse_tests(label: str) -> TestSuite:
    """The TestSuite a code label describes (see the module docstring)."""
    data = json.loads(label)
    if not isinstance(data, dict):
        raise ValueError(f"a code label must be a JSON object, got {type(data).__name__}")
    unknown = set(data) - {
        "testtype",
        "inputs",
        "outputs",
        "fn_name",
        "time_limit",
        "setup",
        "entry_points",
        "tolerance",
    }
    if unknown:
        raise ValueError(f"unknown keys in code label: {sorted(unknown)}")
    return TestSuite(
        testtype=data["testtype"],
        inputs=data["inputs"],
        outputs=data.get("outputs") or (),
        fn_name=data.get("fn_name") or None,
        time_limit=data.get("time_limit"),
        setup=data.get("setup") or "",
        entry_points=data.get("entry_points") or (),
        tolerance=parse_tolerance(data.get("tolerance"), label="code"),
    )


def suite_to_label(suite: TestSuite) -> str:
    """The label text for `suite` (inverse of `parse_tests`)."""
    data: dict[str, Any] = {
        "testtype": suite.testtype,
        "inputs": list(suite.inputs),
        "outputs": list(suite.outputs),
        "fn_name": suite.fn_name,
        "time_limit": suite.time_limit,
        "setup": suite.setup,
    }
    if suite.entry_points:
        data["entry_points"] = list(suite.entry_points)
    if suite.tolerance is not None:
        data["tolerance"] = {"abs": suite.tolerance.abs, "rel": suite.tolerance.rel}
    return json.dumps(data, ensure_ascii=False)


def extract_code(response_text: str) -> str | None:
    """The longest closed fenced block (```lang ... ```), or None when there is none."""
    blocks: list[str] = [block for block in _FENCE.findall(response_text) if block.strip()]
    if not blocks:
        return None
    return max(blocks, key=len)


def judge(suite: TestSuite, executions: Sequence[Execution]) -> list[TestResult]:
    """One TestResult per test of `suite`, from the sandbox's executions (in test order)."""
    if [e.index for e in executions] != list(range(len(suite.inputs))):
        raise ValueError(
            f"expected executions for tests 0..{len(suite.inputs) - 1} in order, "
            f"got indices {[e.index for e in executions]}"
        )
    results = []
    for ex in executions:
        expected = suite.outputs[ex.index] if suite.outputs else None
        common: dict[str, Any] = dict(
            index=ex.index, input=suite.inputs[ex.index], output=ex.output, expected=expected, stderr=ex.stderr
        )
        if ex.status == "timeout":
            results.append(TestResult(outcome="time_limit_exceeded", error=ex.error, **common))
        elif ex.status == "not_run":
            results.append(TestResult(outcome="not_run", error=ex.error, **common))
        elif ex.status == "error":
            results.append(TestResult(outcome="runtime_error", error=ex.error, **common))
        elif ex.status == "failed":
            results.append(TestResult(outcome="wrong_answer", error=ex.error, **common))
        elif suite.testtype == "assert":
            results.append(TestResult(outcome="passed", **common))
        else:
            assert expected is not None
            match = stdout_matches if suite.testtype == "stdin" else value_matches
            outcome: Outcome = "passed" if match(ex.output, expected, suite.tolerance) else "wrong_answer"
            results.append(TestResult(outcome=outcome, **common))
    return results


def _cut(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[:max_chars] + "..."


def _lines(text: str, *, max_chars: int, max_lines: int) -> list[str]:
    lines = text.splitlines() or [""]
    shown = [_cut(line, max_chars) for line in lines[:max_lines]]
    if len(lines) > max_lines:
        shown.append(f"... ({len(lines) - max_lines} more lines)")
    return shown


def _block(title: str, text: str, *, max_chars: int, max_lines: int) -> list[str]:
    return [title, *_lines(text, max_chars=max_chars, max_lines=max_lines)]


def format_feedback(
    results: Sequence[TestResult],
    *,
    max_cases: int = 2,
    max_field_chars: int = 250,
    max_input_lines: int = 8,
    max_chars: int = 2000,
) -> str | None:
    """LeetCode-style text for the failing tests; None when every test passed."""
    failing = [r for r in results if not r.passed]
    if not failing:
        return None
    field = dict(max_chars=max_field_chars, max_lines=max_input_lines)
    parts: list[str] = []

    def debug(r: TestResult) -> None:
        if r.stderr.strip():
            parts.extend(["", *_block("Stderr", r.stderr.strip(), **field)])

    error = next((r for r in failing if r.outcome == "runtime_error"), None)
    timeout = next((r for r in failing if r.outcome == "time_limit_exceeded"), None)
    if error is not None:
        parts.extend(_block("Runtime Error", error.error, **field))
        parts.append("")
        parts.extend(_block("Last Executed Input", error.input, **field))
        debug(error)
    elif timeout is not None:
        parts.extend(["Time Limit Exceeded", ""])
        parts.extend(_block("Last Executed Input", timeout.input, **field))
        debug(timeout)
    else:
        wrong = [r for r in failing if r.outcome == "wrong_answer"]
        if not wrong:  # only not-run tests: cannot happen without an error or timeout before them
            return "Some tests did not run."
        wrong.sort(key=lambda r: (len(r.input) + len(r.output), r.index))
        for r in wrong[:max_cases]:
            parts.extend([f"Test Case {r.index + 1}: Wrong Answer", ""])
            parts.extend(_block("Input", r.input, **field))
            if r.expected is None:  # assert-type test: the failed assertion is the message
                parts.extend(["", *_block("Failure", r.error or "AssertionError", **field)])
            else:
                parts.extend(["", *_block("Output", r.output, **field)])
                parts.extend(["", *_block("Expected", r.expected, **field)])
            debug(r)
            parts.append("")
    text = "\n".join(parts).rstrip()
    return text[:max_chars]


def verify(
    response_text: str,
    label: str,
    *,
    truncated: bool,
    run_tests: TestRunner | None = None,
    partial_credit: bool = False,
    max_cases: int = 2,
) -> Verdict:
    """Score one response: 1.0 iff the longest fenced block passes every test.

    `run_tests` executes a program (tasks.sandbox.program.runner builds one); it is required, since this
    module never runs code itself. With `partial_credit` the reward is the fraction of tests
    passed instead. A truncated response scores 0 without running anything, as the other verifiers
    do: the program it would have ended with is unknown.
    """
    if run_tests is None:
        raise ValueError("the code verifier needs run_tests= (a sandbox runner, e.g. tasks.sandbox.program.runner())")
    suite = parse_tests(label)
    if truncated:
        return Verdict(reward=0.0, feedback=TRUNCATED, truncated=True)
    program = extract_code(response_text)
    if program is None:
        return Verdict(reward=0.0, feedback=FORMAT_ERROR, format_error=True)
    results = judge(suite, list(run_tests(program, suite)))
    passed = sum(r.passed for r in results)
    if partial_credit:
        reward = passed / len(results)
    else:
        reward = 1.0 if passed == len(results) else 0.0
    return Verdict(reward=reward, feedback=format_feedback(results, max_cases=max_cases))
