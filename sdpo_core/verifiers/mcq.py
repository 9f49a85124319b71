"""Verifier for multiple-choice answers given as `<answer>X</answer>` (SciKnowEval, ARC, MMLU, SciQ).

The answer is read from the LAST `<answer>` tag: the text between it and the next `</answer>`.
Inside, the option letter may stand alone ("B"), in brackets ("(B)", "[B]"), with punctuation
("B.", "B)"), lead the option text ("B: mitochondria", "(B) mitochondria") or sit in a sentence
("The answer is B"); in a sentence exactly one distinct option letter must appear as a standalone
capital. A lone lower-case letter ("b") is accepted too. Labels
"True"/"False" (and "Yes"/"No") are compared as words, case-insensitively.

Feedback never names the gold answer: a wrong but well-formed answer gets no feedback at all (on a
two-option question, "B is wrong" would give the answer away), and the format and truncation
messages are the same whatever the label.
"""

from __future__ import annotations

import re

from sdpo_core.records import Verdict

__all__ = ["FORMAT_ERROR", "MULTIPLE_OPTIONS", "TRUNCATED", "extract_answer", "parse_choice", "verify"]

TRUNCATED = "Your response was truncated because it exceeded the maximum length. Give the final answer earlier."
FORMAT_ERROR = (
    "Your answer had the wrong format. End with the final answer as one option letter inside "
    "answer tags, for example <answer>X</answer>."
)
MULTIPLE_OPTIONS = "Your answer named more than one option. Put exactly one option letter inside <answer></answer>."

_OPEN = re.compile(r"<answer>", re.IGNORECASE)
_CLOSE = re.compile(r"</answer>", re.IGNORECASE)
_LEADING_LETTER = re.compile(r"[(\[]?([A-Z])(?:[)\]]|[)\]]?[.:\-])\s")
_STANDALONE_CAPITAL = re.compile(r"(?<![A-Za-z0-9])([A-Z])(?![A-Za-z0-9])")
_BOOLEAN_WORDS = {"true": "true", "false": "false", "yes": "true", "no": "false"}


def extract_answer(response_text: str) -> str | None:
    """The text inside the last `<answer>…</answer>`, or None when the last `<answer>` is not closed."""
    openings = list(_OPEN.finditer(response_text))
    if not openings:
        return None
    start = openings[-1].end()
    close = _CLOSE.search(response_text, start)
    if close is None:
        return None
    return response_text[start : close.start()].strip()


def parse_choice(answer: str, *, letters: str) -> str | None | tuple[str, ...]:
    """The option letter an answer names: a letter, None for none, or a tuple when several are named."""
    bare = answer.strip().strip("()[]{}*.:;,!` \t\n")
    if len(bare) == 1 and bare.upper() in letters:
        return bare.upper()
    leading = _LEADING_LETTER.match(answer.strip())
    if leading is not None and leading.group(1) in letters:  # "B: text of the option", "(C) ..."
        return leading.group(1)
    found = tuple(dict.fromkeys(m.group(1) for m in _STANDALONE_CAPITAL.finditer(answer)))
    found = tuple(letter for letter in found if letter in letters)
    if not found:
        return None
    if len(found) > 1:
        return found
    return found[0]


def verify(response_text: str, label: str, *, truncated: bool, letters: str = "ABCD") -> Verdict:
    """Score one response against an option-letter (or True/False) label; 1.0 iff it names the label.

    `letters` are the valid option letters (a run with five-option questions passes "ABCDE"); a
    truncated response scores 0 with the truncation message, whatever it contains.
    """
    gold = label.strip()
    boolean = gold.lower() in _BOOLEAN_WORDS
    if not boolean and (len(gold) != 1 or gold not in letters):
        raise ValueError(f"label must be one of the option letters {letters!r} or True/False/Yes/No, got {label!r}")
    if truncated:
        return Verdict(reward=0.0, feedback=TRUNCATED, truncated=True)
    answer = extract_answer(response_text)
    if answer is None or not answer:
        return Verdict(reward=0.0, feedback=FORMAT_ERROR, format_error=True)
    if boolean:
        word = _BOOLEAN_WORDS.get(answer.strip(" .!`*").lower())
        if word is None:
            return Verdict(reward=0.0, feedback=FORMAT_ERROR, format_error=True)
        return Verdict(reward=1.0 if word == _BOOLEAN_WORDS[gold.lower()] else 0.0)
    choice = parse_choice(answer, letters=letters)
    if choice is None:
        return Verdict(reward=0.0, feedback=FORMAT_ERROR, format_error=True)
    if isinstance(choice, tuple):
        return Verdict(reward=0.0, feedback=MULTIPLE_OPTIONS, format_error=True)
    return Verdict(reward=1.0 if choice == gold else 0.0)
