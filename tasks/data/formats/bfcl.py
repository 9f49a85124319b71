"""BFCL function calling: bfcl-eval question files with their possible-answer files."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from storage.urls import protocol
from tasks.data.files import Malformed, read_records, resolve_input
from tasks.data.formats.common import TOOL_CALL_INSTRUCTION, field, make_row, nonempty
from tasks.data.rows import BadRow, InvalidRowError, Row


def convert(record: Any, index: int, options: dict) -> Row | None:
    entry_id = nonempty(field(record, "id"), "id")
    turns = field(record, "question", list)
    functions = field(record, "function", list)
    if len(turns) != 1:
        return None  # multi-turn entries need an environment to run the calls; not supported
    turn = turns[0]
    if not isinstance(turn, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in turn):
        raise BadRow("question[0] must be a list of {role, content} messages")
    answers: dict[str, list] = options["_answers"]
    if entry_id in answers:
        ground_truth = answers[entry_id]
    elif options["_no_call"]:
        ground_truth = []
    else:
        raise BadRow(f"no ground truth for id {entry_id!r} in the answers file")
    system = f"{TOOL_CALL_INSTRUCTION}\n\nFunctions:\n{json.dumps(functions, ensure_ascii=False)}"
    extra_system = [m["content"] for m in turn if m.get("role") == "system"]
    if extra_system:
        system += "\n\n" + "\n\n".join(extra_system)
    messages = [{"role": "system", "content": system}] + [
        {"role": str(m["role"]), "content": m["content"]} for m in turn if m.get("role") != "system"
    ]
    label = json.dumps({"ground_truth": ground_truth, "functions": functions}, ensure_ascii=False)
    return make_row(
        prompt_id=f"bfcl-{entry_id}",
        messages=messages,
        label=label,
        data_source="bfcl",
        metadata={"id": entry_id, "num_calls": len(ground_truth)},
    )


def bfcl_answers(source: str, options: dict, storage_options: Mapping[str, Any] | None) -> dict[str, list]:
    """id -> ground truth, from `options["answers"]` or, for a local input, bfcl-eval's layout
    (`possible_answer/<same file name>` next to the question file); {} when there is none."""
    answers = options.get("answers")
    if answers is None:
        if protocol(source) != "file":
            return {}
        local = Path(source.removeprefix("file://"))
        sibling = local.parent / "possible_answer" / local.name
        if not sibling.exists():
            return {}
        answers = str(sibling)
    out: dict[str, list] = {}
    for where, record in read_records(resolve_input(answers), storage_options=storage_options):
        if isinstance(record, Malformed):
            raise InvalidRowError(where, record.reason)
        if not isinstance(record, dict) or "id" not in record or not isinstance(record.get("ground_truth"), list):
            raise InvalidRowError(where, "expected {id, ground_truth: [...]}")
        out[str(record["id"])] = record["ground_truth"]
    return out
