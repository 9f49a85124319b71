"""What every data-set converter shares: the row shape, the prompt texts, field checks and the
multiple-choice layout. A converter raises `BadRow` for a malformed record; the driver adds where."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from tasks.data.rows import BadRow, Row

MCQ_SYSTEM_PROMPT = (
    "Answer the multiple-choice question. Think it through inside <reasoning></reasoning>, then give "
    "only the letter of the correct option inside <answer></answer>, for example:\n"
    "<reasoning>\n...\n</reasoning>\n<answer>\nB\n</answer>"
)


MATH_INSTRUCTION = "Solve the problem step by step, then give the final answer inside \\boxed{}."


CODE_INSTRUCTION = (
    "You are an expert Python programmer. Solve the problem below in Python 3. Each test runs under a "
    "time limit, so aim for an efficient solution. Give your complete program in a single ```python code "
    "block."
)


TOOL_CALL_INSTRUCTION = (
    "You can call the functions described below (JSON schemas). When the request needs function calls, "
    'answer with the calls only, as a JSON list: [{"name": "<function>", "arguments": {...}}]. If no '
    "function fits the request, say so in plain text and call nothing."
)


TOOLALPACA_INSTRUCTION = (
    "You are given an API specification and a user request. Answer by calling the API's tools, each "
    "call written as:\nThought: <your reasoning>\nAction: <tool name>\nAction Input: <JSON object>"
)


LETTERS = "ABCDEFGHIJ"


def field(row: Any, key: str, kind: type | tuple[type, ...] = str) -> Any:
    if not isinstance(row, dict):
        raise BadRow(f"expected a JSON object, got {type(row).__name__}")
    if key not in row or row[key] is None:
        raise BadRow(f"missing field {key!r}")
    value = row[key]
    if not isinstance(value, kind):
        expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise BadRow(f"field {key!r} must be {expected}, got {type(value).__name__}")
    return value


def nonempty(value: str, key: str) -> str:
    if not value.strip():
        raise BadRow(f"field {key!r} is empty")
    return value.strip()


def stable_id(prefix: str, *parts: Any) -> str:
    digest = hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return f"{prefix}-{digest}"


def make_row(*, prompt_id: str, messages: list[dict], label: str, data_source: str, metadata: dict) -> Row:
    return {
        "prompt_id": prompt_id,
        "prompt_messages": messages,
        "label": label,
        "data_source": data_source,
        "metadata": metadata,
    }


def mcq_user_text(question: str, options: Sequence[tuple[str, str]]) -> str:
    """The paper's layout: question, blank line, one "A: text" line per option, the instruction."""
    lines = "\n".join(f"{letter}: {text}" for letter, text in options)
    return f"{question}\n\n{lines}\nPlease reason step by step."


def mcq_row(
    *, prompt_id: str, question: str, options: Sequence[tuple[str, str]], answer: str, data_source: str, metadata: dict
) -> Row:
    letters = [letter for letter, _ in options]
    if answer not in letters:
        raise BadRow(f"answer {answer!r} is not one of the option letters {letters}")
    messages = [
        {"role": "system", "content": MCQ_SYSTEM_PROMPT},
        {"role": "user", "content": mcq_user_text(question, options)},
    ]
    return make_row(
        prompt_id=prompt_id,
        messages=messages,
        label=answer,
        data_source=data_source,
        metadata={**metadata, "num_choices": len(options)},
    )


def option_letter(label: Any, position_labels: Sequence[str]) -> str:
    text = str(label).strip()
    if text in position_labels:
        return LETTERS[list(position_labels).index(text)]
    raise BadRow(f"answer {label!r} is not one of the option labels {list(position_labels)}")
