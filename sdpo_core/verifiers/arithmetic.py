"""Verifier for integer-answer arithmetic prompts, with feedback text in the style of a judge.

The response's final answer is the integer it ends with (an optional trailing period and
whitespace are allowed), so both "82" and "The sum is 82." are read as 82. Answers are compared
by value: leading zeros are tolerated ("082" counts as 82), a sign is honoured ("-82" is not 82).

Feedback is meant to be shown to the self-teacher, the way a code judge shows a failed test's
expected output. A wrong answer therefore reveals the expected value; a format error or a cut-off
response does not, since there is no answer to compare.
"""

from __future__ import annotations

import re

from sdpo_core.records import Verdict

__all__ = [
    "WRONG_ANSWER",
    "YOUR_OUTPUT",
    "EXPECTED",
    "FORMAT_ERROR",
    "TRUNCATED",
    "final_answer",
    "wrong_answer_feedback",
    "verify",
]

# Fixed phrases of the feedback text; the demo tokenizer makes each one token.
WRONG_ANSWER = "Wrong answer."
YOUR_OUTPUT = "Your output:"
EXPECTED = "Expected:"
FORMAT_ERROR = "Format error: the response must end with the answer as a whole number."
TRUNCATED = "Truncated: the response hit the length limit before it ended. Reply with the number only."

_FINAL_INTEGER = re.compile(r"(?<!\d)([+-]?\d{1,1000})\s*\.?\s*\Z", re.ASCII)
_LABEL = re.compile(r"[+-]?\d+", re.ASCII)
_MAX_TAIL_CHARS = 1100  # the longest integer answer (1000 digits) and the spacing after it
_SHOWN_TAIL_CHARS = 20


def final_answer(response_text: str) -> int | None:
    """The integer the response ends with, or None when it does not end with one (or when that
    integer has more than 1000 digits). Only ASCII digits count; linear in the response."""
    tail = response_text.rstrip()[-_MAX_TAIL_CHARS:]
    match = _FINAL_INTEGER.search(tail)
    if match is None or (match.start() == 0 and len(response_text.rstrip()) > len(tail)):
        return None  # no integer at the end, or one too long to be an answer
    return int(match.group(1))


def wrong_answer_feedback(*, answer: int, label: str) -> str:
    """The feedback for a well-formed but wrong answer: what was given and what was expected."""
    return f"{WRONG_ANSWER} {YOUR_OUTPUT} {answer}. {EXPECTED} {label}."


def verify(response_text: str, label: str, *, truncated: bool) -> Verdict:
    """Score one response against an integer label; reward 1.0 iff its final answer equals it.

    `truncated` is the engine's word that generation stopped at the length limit; such a response
    scores 0 whatever it ends with, because the answer it would have given is unknown.
    """
    if _LABEL.fullmatch(label.strip()) is None:
        raise ValueError(f"label must be an integer written in digits, got {label!r}")
    expected = int(label)
    if truncated:
        return Verdict(reward=0.0, feedback=TRUNCATED, truncated=True)
    answer = final_answer(response_text)
    if answer is None:
        tail = response_text.strip()[-_SHOWN_TAIL_CHARS:]
        shown = f" Your output ended with: {tail!r}." if tail else " Your output was empty."
        return Verdict(reward=0.0, feedback=FORMAT_ERROR + shown, format_error=True)
    if answer == expected:
        return Verdict(reward=1.0)
    # the label as written (a zero-padded label stays padded: the expected form of the answer)
    return Verdict(reward=0.0, feedback=wrong_answer_feedback(answer=answer, label=label.strip()))
