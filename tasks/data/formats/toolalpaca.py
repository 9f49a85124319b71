"""ToolAlpaca: one tool's documentation and a user request; the label is the golden tool steps."""

from __future__ import annotations

from typing import Any

from tasks.data.formats.common import (
    TOOLALPACA_INSTRUCTION,
    field,
    make_row,
    nonempty,
    stable_id,
)
from tasks.data.formats.tooluse import steps_label
from tasks.data.rows import Row


def convert(record: Any, index: int, options: dict) -> Row:
    name = nonempty(field(record, "name"), "name")
    documentation = nonempty(field(record, "nl_documentation"), "nl_documentation")
    instruction = nonempty(field(record, "instruction"), "instruction")
    description = str(record.get("description") or "").strip()
    label = steps_label(field(record, "golden_answer", (str, list)))
    user = (
        f"{TOOLALPACA_INSTRUCTION}\n\nTool name: {name}\nTool description: {description}\n"
        f"Tool documentation:\n{documentation}\n\nUser request:\n{instruction}"
    )
    return make_row(
        prompt_id=stable_id("toolalpaca", name, instruction),
        messages=[{"role": "user", "content": user}],
        label=label,
        data_source="toolalpaca",
        metadata={"tool": name, "source_index": index},
    )
