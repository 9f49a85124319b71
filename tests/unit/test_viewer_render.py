"""The viewer's text regions, credit colours and entropy-weight colours."""

from __future__ import annotations

import pytest

from tasks.viewer.render import (
    CREDIT_SCALE,
    WEIGHT_SCALE,
    credit_colour,
    regions,
    segments,
    token_regions,
    weight_colour,
)


def test_regions_find_think_tool_call_and_code_blocks_with_their_tags():
    text = "<think>a</think>b<tool_call>{}</tool_call>c```py\nx\n```d"
    assert [(text[s:e], kind) for s, e, kind in regions(text)] == [
        ("<think>a</think>", "think"),
        ("<tool_call>{}</tool_call>", "tool_call"),
        ("```py\nx\n```", "code"),
    ]


def test_an_unclosed_block_runs_to_the_end():
    assert regions("ok <think>still thinking") == [(3, 24, "think")]
    assert regions("```\ncode") == [(0, 8, "code")]


def test_tags_inside_a_block_do_not_open_another():
    text = "```\n<think>not a think block</think>\n```"
    assert regions(text) == [(0, len(text), "code")]


def test_segments_cover_the_text_exactly_once():
    text = "a<think>b</think>c```d```"
    parts = segments(text)
    assert "".join(p["text"] for p in parts) == text
    assert [p["kind"] for p in parts] == [None, "think", None, "code"]
    assert segments("") == []


def test_token_regions_mark_every_token_overlapping_a_block():
    tokens = ["Hi", " <think>", "hmm", "</think>", "42", "```", "x", "```"]
    assert token_regions(tokens) == [None, "think", "think", "think", None, "code", "code", "code"]
    assert token_regions(["a", "", "b"]) == [None, None, None]


@pytest.mark.parametrize(
    ("credit", "colour"),
    [(0.0, "#ffffff"), (CREDIT_SCALE, "#22a046"), (10 * CREDIT_SCALE, "#22a046"), (-CREDIT_SCALE, "#d63232")],
)
def test_credit_colour_is_white_at_zero_and_saturates_at_the_scale(credit, colour):
    assert credit_colour(credit) == colour


def test_credit_colour_grows_with_the_magnitude_and_keeps_the_sign():
    weak, strong = credit_colour(0.2), credit_colour(1.0)
    # green: the red channel falls as the credit grows
    assert int(strong[1:3], 16) < int(weak[1:3], 16) < 255
    assert credit_colour(-1.0)[1:3] > credit_colour(1.0)[1:3]  # red keeps its red channel high


def test_weight_colour_is_white_at_zero_deepens_with_the_weight_and_saturates_at_the_scale():
    assert weight_colour(0.0) == "#ffffff" == weight_colour(-1.0)
    assert weight_colour(WEIGHT_SCALE) == "#285ac8" == weight_colour(5 * WEIGHT_SCALE)
    light, dark = weight_colour(0.5), weight_colour(1.5)
    assert int(dark[1:3], 16) < int(light[1:3], 16) < 255  # the red channel falls as the weight grows
