"""Numeric verdicts the answer cannot bargain: the expected value decides what counts as equal.

Every verifier that compares numbers (code: standard output and return values; math) meets an
integer expectation only with that exact integer, whatever form the answer writes it in (an int, a
float token, an exponent, signs and spaces), at any magnitude; a tolerance applies only where the
label gives one. The oracle is `decimal.Decimal`, whose comparisons are exact: an answer passes iff
the number its text denotes equals the expected one.
"""

from __future__ import annotations

import json
from decimal import Decimal, localcontext
from fractions import Fraction

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sdpo_core.verifiers import math as math_verifier
from sdpo_core.verifiers.code import Execution, TestSuite, Tolerance, suite_to_label, verify
from sdpo_core.verifiers.code_outputs import stdout_matches, value_matches

PROGRAM = "```python\nprint(0)\n```"
EXPECTED = st.integers(min_value=-(10**30), max_value=10**30)
# ±1, ×(1 ± 1e-9), and the value itself (the control)
PERTURBATIONS = st.sampled_from(["same", "plus one", "minus one", "times 1+1e-9", "times 1-1e-9"])


def perturbed(n: int, how: str) -> Fraction:
    return {
        "same": Fraction(n),
        "plus one": Fraction(n + 1),
        "minus one": Fraction(n - 1),
        "times 1+1e-9": Fraction(n) * (1 + Fraction(1, 10**9)),
        "times 1-1e-9": Fraction(n) * (1 - Fraction(1, 10**9)),
    }[how]


def exact_decimal(value: Fraction) -> str:
    """The exact decimal text of a value with a finite decimal expansion (ours have at most 9 places)."""
    with localcontext() as ctx:
        ctx.prec = 200
        return str(Decimal(value.numerator) / Decimal(value.denominator))


def exponent_form(text: str, *, letter: str = "e") -> str:
    """`text` (a plain decimal) as d.ddd e±k, the same value."""
    with localcontext() as ctx:
        ctx.prec = 200
        return f"{Decimal(text):{letter}}"


def renderings(value: Fraction) -> dict[str, str]:
    """How a program may write `value`: as an int, a float (what Python prints for it), an exponent,
    with a trailing ".0", a plus sign, leading zeros; the text need not denote `value` exactly (a
    float rounds), which the oracle accounts for."""
    plain = exact_decimal(value)
    out = {
        "python float": repr(float(value)),
        "exponent": exponent_form(plain),
        "exponent, capital E": exponent_form(plain, letter="E"),
        "plain": plain,
    }
    if value.denominator == 1:
        out |= {"int .0": f"{value.numerator}.0", "plus sign": f"+{value.numerator}" if value >= 0 else plain}
        out["leading zeros"] = ("-" if value < 0 else "") + "00" + str(abs(value.numerator))
    return out


def denotes(text: str, n: int) -> bool:
    """The oracle: whether the decimal text denotes exactly n."""
    return Decimal(text.strip()) == n


PADDING = st.sampled_from(["", " ", "\t", "  \n", "\n\n", " \r\n"])


@settings(max_examples=400, deadline=None)
@given(n=EXPECTED, how=PERTURBATIONS, data=st.data())
@example(n=974067840, how="plus one", data=None)
@example(n=500000003500000007, how="plus one", data=None)  # n(n+1)/2 for n = 1e9+7, printed by a float
def test_standard_output_meets_an_integer_only_with_that_integer(n, how, data):
    for kind, text in renderings(perturbed(n, how)).items():
        pad = (" ", "\n") if data is None else (data.draw(PADDING), data.draw(PADDING))
        printed = pad[0] + text + pad[1]
        assert stdout_matches(printed, f"{n}\n") is denotes(text, n), (kind, printed)


@settings(max_examples=400, deadline=None)
@given(n=EXPECTED, how=PERTURBATIONS)
@example(n=974067840, how="plus one")
def test_a_return_value_meets_an_integer_only_with_that_integer(n, how):
    value = perturbed(n, how)
    returned = {"python float": json.dumps(float(value)), "exponent": exponent_form(exact_decimal(value))}
    if value.denominator == 1:
        returned["int"] = json.dumps(value.numerator)
    for kind, text in returned.items():
        same = denotes(text, n)
        assert value_matches(text, json.dumps(n)) is same, (kind, text)
        assert value_matches(f" [ {text} ,\n 7]", f"[{n}, 7]") is same, (kind, text)
        assert value_matches(f'{{"a": {text}}}', f'{{"a": {n}}}') is same, (kind, text)


@settings(max_examples=200, deadline=None)
@given(n=EXPECTED, how=PERTURBATIONS)
def test_the_judged_suites_score_only_the_exact_integer(n, how):
    """Through `verify` (a stand-in runner returns what a program printed or returned, both ways)."""
    for text in renderings(perturbed(n, how)).values():
        same = denotes(text, n)
        stdin = TestSuite(testtype="stdin", inputs=["\n"], outputs=[f"{n}\n"])
        run = lambda program, suite, out=text: [Execution(index=0, status="ok", output=out + "\n")]  # noqa: E731
        assert verify(PROGRAM, suite_to_label(stdin), truncated=False, run_tests=run).reward == float(same)
        if _json_number(text):
            functional = TestSuite(testtype="functional", inputs=["1"], outputs=[str(n)], fn_name="f")
            run = lambda program, suite, out=text: [Execution(index=0, status="ok", output=out)]  # noqa: E731
            assert verify(PROGRAM, suite_to_label(functional), truncated=False, run_tests=run).reward == float(same)


def _json_number(text: str) -> bool:
    try:
        return isinstance(json.loads(text), int | float)
    except ValueError:
        return False


@settings(max_examples=300, deadline=None)
@given(n=EXPECTED, how=PERTURBATIONS)
@example(n=974067840, how="plus one")
def test_a_math_answer_meets_an_integer_only_with_that_integer(n, how):
    for kind, text in renderings(perturbed(n, how)).items():
        got = math_verifier.verify(f"so \\boxed{{{text}}}", str(n), truncated=False)
        assert got.reward == float(denotes(text, n)), (kind, text)


@pytest.mark.parametrize(
    ("answer", "label", "same"),
    [
        ("1e20+1", "100000000000000000000", False),
        ("10^{20}+1", "100000000000000000000", False),
        ("2^{64}", "18446744073709551617", False),
        ("2*1.000000000000000001", "2", False),
        ("0.1+0.2", "3/10", True),  # binary floats would leave 5.6e-17 between them
        ("1.1^2", "1.21", True),
    ],
)
def test_a_symbolic_math_answer_is_exact_too(answer, label, same):
    """Decimal literals in an expression are the rationals they denote, never binary floats."""
    assert math_verifier.verify(f"\\boxed{{{answer}}}", label, truncated=False).reward == float(same)


@settings(max_examples=300, deadline=None)
@given(
    expected=st.decimals(min_value=-(10**6), max_value=10**6, places=6, allow_nan=False, allow_infinity=False),
    delta=st.fractions(min_value=-1, max_value=1, max_denominator=10**9),
    tolerance=st.sampled_from([Tolerance(abs=1e-6), Tolerance(rel=1e-6), Tolerance(abs=1e-3, rel=1e-9)]),
)
def test_a_label_that_says_real_valued_applies_its_own_tolerance(expected, delta, tolerance):
    """Only the label's tolerance, exactly: |actual - expected| <= max(abs, rel * |expected|)."""
    e = Fraction(expected)
    actual = e + delta * Fraction(1, 1000)
    within = abs(actual - e) <= max(Fraction(tolerance.abs), Fraction(tolerance.rel) * abs(e))
    printed = exact_decimal(actual)
    assert stdout_matches(printed, str(expected), tolerance) is within
    assert stdout_matches(printed, str(expected)) is (actual == e)  # no label tolerance: exact
    assert value_matches(printed, str(expected), tolerance) is within
    spec = {"abs": tolerance.abs, "rel": tolerance.rel}
    label = json.dumps({"answer": str(expected), "tolerance": spec})
    assert math_verifier.verify(f"\\boxed{{{printed}}}", label, truncated=False).reward == float(within)
    suite = TestSuite(testtype="stdin", inputs=["\n"], outputs=[str(expected)], tolerance=tolerance)
    assert _round_trip(suite) == suite


def _round_trip(suite: TestSuite) -> TestSuite:
    from sdpo_core.verifiers.code import parse_tests

    return parse_tests(suite_to_label(suite))


@pytest.mark.parametrize(
    "spec",
    [{"abs": -1e-6}, {"rel": float("inf")}, {"abs": "1e-6"}, {"abs": True}, {"tol": 1e-6}, {}, [1e-6]],
)
def test_a_malformed_tolerance_is_a_label_error(spec):
    from sdpo_core.verifiers.code import parse_tests

    label = {"testtype": "stdin", "inputs": ["1"], "outputs": ["1"], "tolerance": spec}
    with pytest.raises(ValueError, match="tolerance"):
        parse_tests(json.dumps(label))
    with pytest.raises(ValueError, match="tolerance"):
        math_verifier.verify("\\boxed{1}", json.dumps({"answer": "1", "tolerance": spec}), truncated=False)


def test_assert_suites_take_no_tolerance():
    with pytest.raises(ValueError, match="assert tests carry no tolerance"):
        TestSuite(testtype="assert", inputs=["assert f()"], entry_points=("f",), tolerance=Tolerance(abs=1.0))


@pytest.mark.parametrize(
    ("printed", "expected", "same"),
    [
        ("1e999999", "1e999999", True),  # exact at any magnitude, no big number built
        ("10e999998", "1e999999", True),
        ("1e999999", "1.0000000000000000001e999999", False),
        ("1e" + "9" * 19, "1e" + "9" * 19, True),  # an exponent past 18 digits is text
        ("1e" + "9" * 19, "1e" + "9" * 18 + "8", False),
        ("0.000", "-0", True),
        ("-0e5", "0", True),
        ("1" + "0" * 5000, "1e5000", True),
        (".5", "0.50", True),
        ("5.", "5", True),
        ("inf", "inf", True),  # text
        ("nan", "NaN", False),
    ],
)
def test_numbers_compare_as_exact_decimals_at_any_size(printed, expected, same):
    assert stdout_matches(printed, expected) is same
    assert stdout_matches(printed, expected, Tolerance(abs=1e-6, rel=1e-6)) is same
