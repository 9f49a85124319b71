"""How a code test's output is compared with the expected one: standard output token by token,
return values as JSON. Pure, and total: whatever a program printed or returned, these answer True
or False in linear time and never raise.

The expected value decides, never the program. A number compares by the value its text denotes,
read as an exact decimal (never through a binary float) at any magnitude: "974067840",
"974067840.0", "+9.7406784e8" and "0974067840" are one value, "974067841.0" another, whether the
program printed an int or a float. A tolerance applies only where the task's label gives one
(`Tolerance`: the label says its answers are real-valued), and then it is the label's:
|actual - expected| <= max(abs, rel * |expected|), computed exactly. Only ASCII digits are digits
and only ASCII whitespace separates tokens, so a digit or a space of another script is text.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from fractions import Fraction

__all__ = ["Tolerance", "number_value", "numbers_match", "parse_tolerance", "stdout_matches", "value_matches"]

# ASCII only: a digit of another script is no digit here (str patterns' \d would take them)
_NUMBER = re.compile(r"([+-]?)([0-9]*)(?:\.([0-9]*))?(?:[eE]([+-]?[0-9]+))?")
_ASCII_SPACE = " \t\n\r\x0b\x0c"
_SPACE = re.compile(r"[ \t\r\x0b\x0c]+")
_MAX_EXPONENT_CHARS = 18  # a longer exponent is compared as text (no int is built from it)
_MAX_TOLERANT_DIGITS = 1000  # past this many digits or orders of magnitude, only exact equality
_MAX_DEPTH = 200  # deeper return values match nothing


@dataclass(frozen=True)
class Tolerance:
    """A real-valued answer's tolerance, from the task's label: absolute and relative (to the
    expected value); each finite and >= 0."""

    abs: float = 0.0
    rel: float = 0.0

    def __post_init__(self) -> None:
        for name in ("abs", "rel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
                raise ValueError(f"tolerance {name} must be a finite number >= 0, got {value!r}")


def parse_tolerance(spec: object, *, label: str) -> Tolerance | None:
    """A label's `tolerance` (`{"abs": x, "rel": y}`, either may be left out), or None when it gives
    none; ValueError naming the `label` kind for anything else."""
    if spec is None:
        return None
    if not isinstance(spec, dict) or not spec or set(spec) - {"abs", "rel"}:
        raise ValueError(f'a {label} label\'s tolerance must be {{"abs": x, "rel": y}} (either or both), got {spec!r}')
    return Tolerance(abs=spec.get("abs", 0.0), rel=spec.get("rel", 0.0))


@dataclass(frozen=True)
class _Decimal:
    """A number as (sign, significant digits, power of ten): value = ±int(digits) * 10**exponent,
    digits without leading or trailing zeros ("" for zero, whose sign is +). Equal iff equal values."""

    negative: bool
    digits: str
    exponent: int

    def magnitude(self) -> int:
        """The power of ten of the leading digit (0 for zero)."""
        return self.exponent + len(self.digits) - 1 if self.digits else 0

    def fraction(self) -> Fraction:
        value = Fraction(int(self.digits or "0")) * Fraction(10) ** self.exponent
        return -value if self.negative else value


def number_value(token: str) -> _Decimal | None:
    """The exact value of a decimal token ("-12", "1.50", ".5", "5.", "1e-3", "+2E+08"), or None for
    anything else (text, or an exponent of more than 18 digits). Linear in the token."""
    match = _NUMBER.fullmatch(token)
    if match is None:
        return None
    sign, whole, decimals, exponent = match.groups()
    decimals = decimals or ""
    if not whole and not decimals:
        return None  # ".", "e5", "+", ""
    if exponent is not None and len(exponent.lstrip("+-")) > _MAX_EXPONENT_CHARS:
        return None
    digits = (whole + decimals).lstrip("0")
    power = (int(exponent) if exponent is not None else 0) - len(decimals)
    stripped = digits.rstrip("0")
    power += len(digits) - len(stripped)
    if not stripped:
        return _Decimal(False, "", 0)
    return _Decimal(sign == "-", stripped, power)


def numbers_match(actual: _Decimal, expected: _Decimal, tolerance: Tolerance | None = None) -> bool:
    """Equal values; or, with the label's `tolerance`, |actual - expected| <= max(abs, rel * |expected|)
    (exactly; numbers of over 1000 digits or orders of magnitude only compare equal)."""
    if actual == expected:
        return True
    if tolerance is None or (tolerance.abs == 0 and tolerance.rel == 0):
        return False
    bounded = all(
        len(x.digits) <= _MAX_TOLERANT_DIGITS and abs(x.magnitude()) <= _MAX_TOLERANT_DIGITS and x.exponent > -2000
        for x in (actual, expected)
    )
    if not bounded:
        return False
    e = expected.fraction()
    allowed = max(Fraction(tolerance.abs), Fraction(tolerance.rel) * abs(e))
    return abs(actual.fraction() - e) <= allowed


def _tokens_match(actual: str, expected: str, tolerance: Tolerance | None) -> bool:
    if actual == expected:
        return True
    a, e = number_value(actual), number_value(expected)
    return a is not None and e is not None and numbers_match(a, e, tolerance)


def _tokens(line: str) -> list[str]:
    line = line.strip(_ASCII_SPACE)
    return _SPACE.split(line) if line else []


def _token_lines(text: str) -> list[list[str]]:
    return [_tokens(line) for line in text.strip(_ASCII_SPACE).split("\n")]


def stdout_matches(actual: str, expected: str, tolerance: Tolerance | None = None) -> bool:
    """Line-by-line comparison of tokens separated by ASCII whitespace (surrounding whitespace and blank
    trailing lines ignored): numbers by their exact value (within the label's `tolerance`, when it
    gives one), other tokens as text."""
    a_lines, e_lines = _token_lines(actual), _token_lines(expected)
    if len(a_lines) != len(e_lines):
        return False
    for a_tokens, e_tokens in zip(a_lines, e_lines, strict=True):
        if len(a_tokens) != len(e_tokens):
            return False
        if not all(_tokens_match(a, e, tolerance) for a, e in zip(a_tokens, e_tokens, strict=True)):
            return False
    return True


@dataclass(frozen=True)
class _Verbatim:
    """A JSON number with an exponent past 18 digits, or a constant (NaN, Infinity): equal only to
    the same text, NaN to nothing."""

    text: str


def _json_number(token: str) -> _Decimal | _Verbatim:
    value = number_value(token)
    return _Verbatim(token) if value is None else value


def _values_equal(actual: object, expected: object, tolerance: Tolerance | None, depth: int = 0) -> bool:
    if depth > _MAX_DEPTH:
        return False
    if isinstance(actual, bool) or isinstance(expected, bool):
        return actual is expected
    if isinstance(actual, _Decimal) and isinstance(expected, _Decimal):
        return numbers_match(actual, expected, tolerance)
    if isinstance(actual, list) and isinstance(expected, list):
        return len(actual) == len(expected) and all(
            _values_equal(a, e, tolerance, depth + 1) for a, e in zip(actual, expected, strict=True)
        )
    if isinstance(actual, dict) and isinstance(expected, dict):
        return actual.keys() == expected.keys() and all(
            _values_equal(actual[k], expected[k], tolerance, depth + 1) for k in actual
        )
    if isinstance(expected, _Verbatim) and expected.text == "NaN":
        return False
    return type(actual) is type(expected) and actual == expected  # strings, None, verbatim numbers


_NOT_JSON = object()


def _load_json(text: str) -> object:
    """The JSON value of `text`, every number exact (`_Decimal`), or _NOT_JSON."""
    try:
        return json.loads(text, parse_int=_json_number, parse_float=_json_number, parse_constant=_Verbatim)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's stack
        return _NOT_JSON


def value_matches(actual_json: str, expected_json: str, tolerance: Tolerance | None = None) -> bool:
    """A functional test's return value (JSON text) against the expected JSON text: numbers by their
    exact value (within the label's `tolerance`, when it gives one), an int and a float alike. Never
    raises, whatever the program returned."""
    actual = _load_json(actual_json)
    if actual is _NOT_JSON:
        return False
    expected = _load_json(expected_json)
    if expected is _NOT_JSON:
        return actual_json.strip() == expected_json.strip()
    return _values_equal(actual, expected, tolerance)
