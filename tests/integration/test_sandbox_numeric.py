"""Numeric verdicts at the process level: real programs print or return integers up to 10^30 and
their perturbations, in every form a program may choose, and only the exact integer passes.

One program per suite kind answers every case of a seeded matrix (values, perturbations ±1 and
×(1 ± 1e-9), renderings as an int, a float, an exponent, with signs, zeros and spaces): standard
output, a functional test's return value (the sandbox carries it as JSON), and an assert suite
(the test code compares in the judge's process). The oracle is `decimal.Decimal`, exact: a test
passes iff what the program wrote denotes the expected integer. The issue's examples are cases:
`float(a * b % 1000000007 + 1)` against 974067840, `n * (n + 1) / 2` for n = 1000000007, an
18-digit product off by about 5e10.
"""

from __future__ import annotations

import json
import random
from decimal import Decimal, localcontext
from fractions import Fraction

import pytest

from sdpo_core.verifiers.code import TestSuite, judge
from tasks.sandbox.program import SandboxLimits, run_program
from tests.integration.test_sandbox import (  # the uid recorder: leftover checks see this process's sandboxes
    FAST,
    LEVELS,
    _record_sandbox_uids,  # noqa: F401 -- an autouse fixture, imported to apply here
)

SEED = 55
LIMITS = {"per_test_s": 3.0, "total_s": 240.0, "memory_mb": FAST["memory_mb"], "file_mb": FAST["file_mb"]}
PERTURBATIONS = {
    "same": lambda n: Fraction(n),
    "plus one": lambda n: Fraction(n + 1),
    "minus one": lambda n: Fraction(n - 1),
    "times 1+1e-9": lambda n: Fraction(n) * (1 + Fraction(1, 10**9)),
    "times 1-1e-9": lambda n: Fraction(n) * (1 - Fraction(1, 10**9)),
}


def expected_values() -> list[int]:
    rng = random.Random(SEED)
    drawn = [rng.randrange(-(10**30), 10**30) for _ in range(5)] + [rng.randrange(10**17, 10**18) for _ in range(2)]
    a, b = 123456789, 987654321
    return [a * b % 1000000007, 1000000007 * 1000000008 // 2, 999999999 * 999999937, *drawn, 0]


def exact_text(value: Fraction) -> str:
    with localcontext() as ctx:
        ctx.prec = 200
        return str(Decimal(value.numerator) / Decimal(value.denominator))


def printed_forms(value: Fraction) -> list[str]:
    """What a program may print for `value`: a float, an exponent, the exact digits; an int with
    ".0", a plus sign, leading zeros; spaces around."""
    text = exact_text(value)
    with localcontext() as ctx:
        ctx.prec = 200
        exponent = f"{Decimal(text):E}"
    forms = [repr(float(value)), f" {exponent}\t", text]
    if value.denominator == 1:
        n = value.numerator
        forms += [f"{n}.0", f"  +{n}  " if n >= 0 else f"  {n}  ", ("-" if n < 0 else "") + f"000{abs(n)}\n\n"]
    return forms


def denotes(text: str, n: int) -> bool:
    return Decimal(text.strip()) == n


def cases() -> list[tuple[int, str, Fraction]]:
    return [(n, how, perturb(n)) for n in expected_values() for how, perturb in PERTURBATIONS.items()]


def outcomes(program: str, suite: TestSuite, limits: SandboxLimits) -> list[bool]:
    return [r.passed for r in judge(suite, run_program(program, suite, limits=limits))]


@pytest.mark.parametrize("limits", [LEVELS["namespace+guard"], LEVELS["process"]])
def test_standard_output_passes_only_the_exact_integer(limits):
    rows = [(n, text) for n, _, value in cases() for text in printed_forms(value)]
    program = f"TEXTS = {json.dumps([text for _, text in rows])}\nprint(TEXTS[int(input())], end='')\n"
    suite = TestSuite(testtype="stdin", inputs=[f"{i}\n" for i in range(len(rows))], outputs=[str(n) for n, _ in rows])
    got = outcomes(program, suite, SandboxLimits(**{**limits.__dict__, **LIMITS}))
    wrong = [(n, text, ok) for (n, text), ok in zip(rows, got, strict=True) if ok is not denotes(text, n)]
    assert wrong == []
    assert sum(got) >= len(expected_values()) * 4  # the controls pass (exact digits, +, zeros, ".0")


@pytest.mark.parametrize("limits", [LEVELS["namespace+guard"], LEVELS["process"]])
def test_a_returned_float_passes_only_when_it_is_the_exact_integer(limits):
    """The program returns Python floats and ints; the issue's `return float(ans + 1)` is a case."""
    rows = []
    for n, _, value in cases():
        rows.append((n, repr(float(value))))
        if value.denominator == 1:
            rows.append((n, str(value.numerator)))
    program = f"VALUES = [{', '.join(text for _, text in rows)}]\n\ndef f(i):\n    return VALUES[i]\n"
    suite = TestSuite(
        testtype="functional", inputs=[str(i) for i in range(len(rows))], outputs=[str(n) for n, _ in rows], fn_name="f"
    )
    got = outcomes(program, suite, SandboxLimits(**{**limits.__dict__, **LIMITS}))
    wrong = [(n, text, ok) for (n, text), ok in zip(rows, got, strict=True) if ok is not denotes(text, n)]
    assert wrong == []
    assert sum(got) >= len(expected_values())


@pytest.mark.parametrize("limits", [LEVELS["namespace+guard"], LEVELS["process"]])
def test_an_assert_suite_compares_exactly(limits):
    rows = [(n, repr(float(value))) for n, _, value in cases()]
    rows += [(n, str(value.numerator)) for n, _, value in cases() if value.denominator == 1]
    program = f"VALUES = [{', '.join(text for _, text in rows)}]\n\ndef f(i):\n    return VALUES[i]\n"
    suite = TestSuite(
        testtype="assert", inputs=[f"assert f({i}) == {n}" for i, (n, _) in enumerate(rows)], entry_points=("f",)
    )
    got = outcomes(program, suite, SandboxLimits(**{**limits.__dict__, **LIMITS}))
    wrong = [(n, text, ok) for (n, text), ok in zip(rows, got, strict=True) if ok is not denotes(text, n)]
    assert wrong == []
    assert sum(got) >= len(expected_values())
