"""ToolUse: the paper's JSON lines (`prompt`, `answer` = a JSON list of Action / Action_Input steps)."""

from __future__ import annotations

import json
from typing import Any

from tasks.data.formats.common import field, make_row, nonempty
from tasks.data.rows import BadRow, Row


def steps_label(steps: Any) -> str:
    """Canonical tool-step label: a JSON list of {"Action": name, "Action_Input": "<json object text>"}."""
    if isinstance(steps, str):
        try:
            steps = json.loads(steps)
        except json.JSONDecodeError as exc:
            raise BadRow(f"the gold answer is not valid JSON ({exc.msg})") from None
    if not isinstance(steps, list) or not steps:
        raise BadRow("the gold answer must be a non-empty list of steps")
    out = []
    for k, step in enumerate(steps):
        if not isinstance(step, dict) or not isinstance(step.get("Action"), str) or not step["Action"].strip():
            raise BadRow(f"gold step {k + 1} needs a non-empty 'Action'")
        raw = step.get("Action_Input", "")
        if isinstance(raw, str):
            try:
                args = json.loads(raw) if raw.strip() else {}
            except json.JSONDecodeError as exc:
                raise BadRow(f"gold step {k + 1}: Action_Input is not valid JSON ({exc.msg})") from None
        else:
            args = raw if raw is not None else {}
        if not isinstance(args, dict):
            raise BadRow(f"gold step {k + 1}: Action_Input must be a JSON object")
        out.append({"Action": step["Action"].strip(), "Action_Input": json.dumps(args, ensure_ascii=False)})
    return json.dumps(out, ensure_ascii=False)


def convert(record: Any, index: int, options: dict) -> Row:
    prompt = nonempty(field(record, "prompt"), "prompt")
    label = steps_label(field(record, "answer", (str, list)))
    system = (record.get("system") or "").strip()
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    source_index = record.get("idx", index)
    return make_row(
        prompt_id=f"tooluse-{source_index}",
        messages=messages,
        label=label,
        data_source="tooluse",
        metadata={"source_index": source_index, "task_type": record.get("kind", "tooluse")},
    )
