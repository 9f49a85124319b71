"""How a code test's output is compared with the expected one: standard output token by token,
return values as JSON. Pure, and total: whatever a program printed or returned, these answer True
or False in linear time and never raise.

Integer tokens and `int` values compare exactly (a sign and leading zeros aside, at any length);
only where either side is a float is the tolerance used (1e-6, relative and absolute). Only ASCII
digits are digits and only ASCII whitespace separates tokens, so a digit or a space of another
script is text.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

__all__ = ["stdout_matches", "value_matches"]

# ASCII only: a digit of another script is no digit here (str patterns' \d would take them)
_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?([0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)([eE][+-]?[0-9]+)?")
_ASCII_SPACE = " \t\n\r\x0b\x0c"
_SPACE = re.compile(r"[ \t\r\x0b\x0c]+")
_ABS_TOL = 1e-6
_REL_TOL = 1e-6
_MAX_FLOAT_CHARS = 1000  # a longer float token is compared as text
_MAX_INT_CHARS = 4000  # a longer JSON integer is compared by its digits (below the int string limit)
_MAX_DEPTH = 200  # deeper return values match nothing


def _canonical_int(token: str) -> str:
    """An integer token without its plus sign and leading zeros ("-0" is "0"): equal iff equal values."""
    negative = token.startswith("-")
    digits = token.lstrip("+-").lstrip("0") or "0"
    return "-" + digits if negative and digits != "0" else digits


def _tokens_match(actual: str, expected: str) -> bool:
    if actual == expected:
        return True
    if _INT.fullmatch(actual) and _INT.fullmatch(expected):
        return _canonical_int(actual) == _canonical_int(expected)
    if not (_FLOAT.fullmatch(actual) and _FLOAT.fullmatch(expected)):
        return False
    if max(len(actual), len(expected)) > _MAX_FLOAT_CHARS:
        return False  # compared as text (above)
    a, e = float(actual), float(expected)
    return math.isfinite(a) and math.isfinite(e) and math.isclose(a, e, rel_tol=_REL_TOL, abs_tol=_ABS_TOL)


def _tokens(line: str) -> list[str]:
    line = line.strip(_ASCII_SPACE)
    return _SPACE.split(line) if line else []


def _token_lines(text: str) -> list[list[str]]:
    return [_tokens(line) for line in text.strip(_ASCII_SPACE).split("\n")]


def stdout_matches(actual: str, expected: str) -> bool:
    """Line-by-line comparison of tokens separated by ASCII whitespace (surrounding whitespace and blank
    trailing lines ignored): integer tokens compare exactly, a float on either side with tolerance."""
    a_lines, e_lines = _token_lines(actual), _token_lines(expected)
    if len(a_lines) != len(e_lines):
        return False
    for a_tokens, e_tokens in zip(a_lines, e_lines, strict=True):
        if len(a_tokens) != len(e_tokens):
            return False
        if not all(_tokens_match(a, e) for a, e in zip(a_tokens, e_tokens, strict=True)):
            return False
    return True


@dataclass(frozen=True)
class _Verbatim:
    """A JSON number no int or float holds (past the int string limit, or a float overflowing to
    infinity); equal only to the same text (integers canonical)."""

    text: str


def _json_int(token: str) -> int | _Verbatim:
    return int(token) if len(token) <= _MAX_INT_CHARS else _Verbatim(_canonical_int(token))


def _json_float(token: str) -> float | _Verbatim:
    value = float(token)
    return value if math.isfinite(value) else _Verbatim(token)


def _values_equal(actual: object, expected: object, depth: int = 0) -> bool:
    if depth > _MAX_DEPTH:
        return False
    if isinstance(actual, bool) or isinstance(expected, bool):
        return actual is expected
    if isinstance(actual, float) or isinstance(expected, float):
        if not isinstance(actual, (int, float)) or not isinstance(expected, (int, float)):
            return False
        try:
            return math.isclose(actual, expected, rel_tol=_REL_TOL, abs_tol=_ABS_TOL)
        except OverflowError:  # an int beyond a float's range is close to no float
            return False
    if isinstance(actual, list) and isinstance(expected, list):
        return len(actual) == len(expected) and all(
            _values_equal(a, e, depth + 1) for a, e in zip(actual, expected, strict=True)
        )
    if isinstance(actual, dict) and isinstance(expected, dict):
        return actual.keys() == expected.keys() and all(
            _values_equal(actual[k], expected[k], depth + 1) for k in actual
        )
    return type(actual) is type(expected) and actual == expected  # ints exactly, strings, None


_NOT_JSON = object()


def _load_json(text: str) -> object:
    """The JSON value of `text` (integers of any length), or _NOT_JSON."""
    try:
        return json.loads(text, parse_int=_json_int, parse_float=_json_float)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's stack
        return _NOT_JSON


def value_matches(actual_json: str, expected_json: str) -> bool:
    """A functional test's return value (JSON text) against the expected JSON text: ints exactly, a
    float on either side with tolerance. Never raises, whatever the program returned."""
    actual = _load_json(actual_json)
    if actual is _NOT_JSON:
        return False
    expected = _load_json(expected_json)
    if expected is _NOT_JSON:
        return actual_json.strip() == expected_json.strip()
    return _values_equal(actual, expected)
