"""What the web page and the terminal viewer render alike: text regions and the credit colours.

Regions: `<think>` blocks, tool calls (`<tool_call>` blocks, the Hermes / Qwen format) and fenced
code blocks. A block left open (the response ran out of tokens) runs to the end of the text.

Credit: a response token's teacher-minus-student log-probability of the sampled token,
`teacher_sampled_logprobs - sampled_logprobs` (SDPO's per-token advantage, in nats). Positive
credit (the teacher, shown the demonstration or feedback, likes the token more) is green, negative
red, zero white; the colour saturates at |credit| = CREDIT_SCALE.

Entropy weight (SRPO): a token's weight in the SDPO loss, exp(-beta * H) normalised to mean 1 over
the SDPO tokens (`tasks.viewer.data`). White at 0, blue deepening with the weight, saturated at
WEIGHT_SCALE: tokens where the teacher is confident are dark, tokens where it hesitates pale.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

RegionKind = Literal["think", "tool_call", "code"]
CREDIT_SCALE = 2.0
WEIGHT_SCALE = 2.0
_WEIGHT = (40, 90, 200)
_POSITIVE = (34, 160, 70)
_NEGATIVE = (214, 50, 50)
_OPENERS = re.compile(r"<think>|<tool_call>|```")
_CLOSERS: dict[str, tuple[str, RegionKind]] = {
    "<think>": ("</think>", "think"),
    "<tool_call>": ("</tool_call>", "tool_call"),
    "```": ("```", "code"),
}


def regions(text: str) -> list[tuple[int, int, RegionKind]]:
    """Character spans [start, end) of the highlighted blocks of `text`, tags included, in order."""
    spans: list[tuple[int, int, RegionKind]] = []
    position = 0
    while (match := _OPENERS.search(text, position)) is not None:
        closer, kind = _CLOSERS[match.group(0)]
        close_at = text.find(closer, match.end())
        end = len(text) if close_at == -1 else close_at + len(closer)
        spans.append((match.start(), end, kind))
        position = end
    return spans


def segments(text: str) -> list[dict[str, str | None]]:
    """`text` cut into consecutive pieces [{"kind": RegionKind | None, "text": str}]."""
    out: list[dict[str, str | None]] = []
    position = 0
    for start, end, kind in regions(text):
        if start > position:
            out.append({"kind": None, "text": text[position:start]})
        out.append({"kind": kind, "text": text[start:end]})
        position = end
    if position < len(text):
        out.append({"kind": None, "text": text[position:]})
    return out


def token_regions(token_texts: Sequence[str]) -> list[RegionKind | None]:
    """The region each token of a response overlaps (the first, if it touches two), or None."""
    spans = regions("".join(token_texts))
    kinds: list[RegionKind | None] = []
    start, span = 0, 0
    for piece in token_texts:
        end = start + len(piece)
        while span < len(spans) and spans[span][1] <= start:
            span += 1
        overlaps = span < len(spans) and spans[span][0] < max(end, start + 1) and start < spans[span][1]
        kinds.append(spans[span][2] if overlaps else None)
        start = end
    return kinds


def _blend(target: tuple[int, int, int], amount: float) -> str:
    """ "#rrggbb" a share `amount` in [0, 1] of the way from white to `target`."""
    channels = (round(255 + (c - 255) * amount) for c in target)
    return "#" + "".join(f"{c:02x}" for c in channels)


def credit_colour(credit: float) -> str:
    """The background colour "#rrggbb" of a token with this credit."""
    return _blend(_POSITIVE if credit > 0 else _NEGATIVE, min(abs(credit) / CREDIT_SCALE, 1.0))


def weight_colour(weight: float) -> str:
    """The background colour "#rrggbb" of a token with this entropy weight (>= 0)."""
    return _blend(_WEIGHT, min(max(weight, 0.0) / WEIGHT_SCALE, 1.0))
