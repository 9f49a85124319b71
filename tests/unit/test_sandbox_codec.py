"""Plain values across the sandbox's runner/judge boundary: what the program returns is rebuilt
from exact builtin types, so none of its own objects reaches the test code."""

from __future__ import annotations

import math

import pytest

from tasks.sandbox.codec import CodecError, decode, encode, to_json


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        False,
        0,
        -7,
        2**200,
        1.5,
        float("inf"),
        "text",
        b"\x00\xff",
        1 + 2j,
        [1, [2, (3, "x")]],
        (1,),
        {"a": 1, 2: [3]},
        {1, 2},
        frozenset({"x"}),
        {(1, 2): {"k": None}},
    ],
)
def test_plain_values_round_trip_with_their_exact_types(value):
    back = decode(encode(value))
    assert back == value and type(back) is type(value)


def test_nan_round_trips():
    assert math.isnan(decode(encode(float("nan"))))


class Anything:
    def __eq__(self, other):
        return True


class SneakyInt(int):
    def __eq__(self, other):
        return True


@pytest.mark.parametrize(
    "value", [Anything(), SneakyInt(3), [1, Anything()], {"k": SneakyInt(1)}, type("L", (list,), {})(), print, range(3)]
)
def test_objects_of_the_program_are_refused(value):
    with pytest.raises(CodecError, match="plain types only"):
        encode(value)
    with pytest.raises(CodecError, match="plain types only"):
        to_json(value)


def test_depth_and_size_are_bounded():
    deep: list = []
    for _ in range(200):
        deep = [deep]
    with pytest.raises(CodecError, match="deeper than 100"):
        encode(deep)
    with pytest.raises(CodecError, match="20000 bits"):
        encode(2**30000)


def test_json_keys_must_be_text():
    assert to_json({"a": [1, 2.5, None]}) == '{"a": [1, 2.5, null]}'
    with pytest.raises(CodecError, match="dict key of type int"):
        to_json({1: 2})
