"""SciKnowEval multiple choice: the paper's flat JSON lines or raw SciKnowEval rows (L3 kept)."""

from __future__ import annotations

from typing import Any

from tasks.data.formats.common import (
    LETTERS,
    field,
    make_row,
    mcq_row,
    nonempty,
    stable_id,
)
from tasks.data.rows import BadRow, Row

SCIKNOWEVAL_DOMAINS = ("biology", "chemistry", "material", "physics")


SCIKNOWEVAL_TYPES = ("mcq-4-choices", "mcq-2-choices")


def convert(record: Any, index: int, options: dict) -> Row | None:
    if isinstance(record, dict) and isinstance(record.get("prompt"), str) and "answer" in record:
        return _sciknoweval_flat(record, index, options)
    return _sciknoweval_raw(record, index, options)


def _sciknoweval_flat(record: Row, index: int, options: dict) -> Row:
    prompt = nonempty(field(record, "prompt"), "prompt")
    answer = nonempty(field(record, "answer"), "answer")
    if answer not in LETTERS:
        raise BadRow(f"answer must be an option letter, got {answer!r}")
    system = (record.get("system") or "").strip()
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    source_index = record.get("idx", index)
    metadata = {"domain": options.get("domain"), "task_type": record.get("kind", "mcq"), "source_index": source_index}
    return make_row(
        prompt_id=f"sciknoweval-{options.get('domain') or 'all'}-{source_index}",
        messages=messages,
        label=answer,
        data_source="sciknoweval",
        metadata=metadata,
    )


def _sciknoweval_raw(record: Any, index: int, options: dict) -> Row | None:
    details = field(record, "details", dict)
    level = str(details.get("level", ""))
    domain = str(field(record, "domain")).strip()
    task_type = str(field(record, "type")).strip()
    domains = {d.lower().rstrip("s") for d in options.get("domains", SCIKNOWEVAL_DOMAINS)}
    if level.upper() not in {lv.upper() for lv in options.get("levels", ("L3",))}:
        return None
    if domain.lower().rstrip("s") not in domains or task_type not in options.get("types", SCIKNOWEVAL_TYPES):
        return None
    question = nonempty(field(record, "question"), "question")
    choices = field(record, "choices", dict)
    texts, labels = choices.get("text"), choices.get("label")
    if not isinstance(texts, list) or not isinstance(labels, list) or len(texts) != len(labels) or not texts:
        raise BadRow("choices must hold equal-length, non-empty 'text' and 'label' lists")
    options_list = [(str(lab).strip(), str(txt).strip()) for lab, txt in zip(labels, texts, strict=True)]
    answer = nonempty(field(record, "answerKey"), "answerKey")
    source_id = record.get("id", details.get("id", index))
    metadata = {
        "domain": domain,
        "task_type": task_type,
        "level": level,
        "task": details.get("task"),
        "subtask": details.get("subtask"),
        "source_index": source_id,
    }
    return mcq_row(
        prompt_id=stable_id("sciknoweval", domain, question, options_list),
        question=question,
        options=options_list,
        answer=answer,
        data_source="sciknoweval",
        metadata=metadata,
    )
