"""LiveCodeBench code_generation_lite rows; train keeps a seeded share of each problem's tests, test keeps all."""

from __future__ import annotations

import base64
import io
import json
import pickle
import random
import zlib
from typing import Any

from tasks.data.formats.common import CODE_INSTRUCTION, field, make_row, nonempty
from tasks.data.rows import BadRow, Row


class _NoGlobalsUnpickler(pickle.Unpickler):
    """LiveCodeBench pickles a plain str; refusing every global makes loading it safe."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a test-case payload")


def _lcb_cases(payload: Any, key: str) -> list[dict]:
    if isinstance(payload, list):
        return payload
    if not isinstance(payload, str):
        raise BadRow(f"{key} must be a JSON list or text")
    text = payload.strip()
    if not text:
        return []
    if text[0] != "[":  # base64(zlib(pickle(json text))) as code_generation_lite stores private tests
        try:
            raw = _NoGlobalsUnpickler(io.BytesIO(zlib.decompress(base64.b64decode(text, validate=True)))).load()
        except (ValueError, zlib.error, pickle.UnpicklingError, EOFError) as exc:
            raise BadRow(f"{key} is neither JSON nor the compressed form ({type(exc).__name__}: {exc})") from None
        if not isinstance(raw, str):
            raise BadRow(f"{key} decoded to a {type(raw).__name__}, expected JSON text")
        text = raw
    try:
        cases = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadRow(f"{key} is not valid JSON ({exc.msg})") from None
    if not isinstance(cases, list):
        raise BadRow(f"{key} must be a list of test cases")
    return cases


def _half_of_tests(
    inputs: list[str], outputs: list[str], *, seed: int, key: str, fraction: float
) -> tuple[list[str], list[str]]:
    """A seeded random `fraction` of one problem's tests (at least one), in their original order.

    Seeded per problem (seed, question id), so the subset does not depend on row order or filters.
    """
    n = len(inputs)
    keep = sorted(random.Random(f"{seed}:{key}").sample(range(n), max(1, round(n * fraction))))
    return [inputs[i] for i in keep], [outputs[i] for i in keep]


def convert(record: Any, index: int, options: dict) -> Row:
    from sdpo_core.verifiers.code import TestSuite, suite_to_label

    if isinstance(record, dict) and "tests" in record and ("problem" in record or "prompt" in record):
        problem = nonempty(field(record, "problem" if "problem" in record else "prompt"), "problem")
        tests = field(record, "tests", (str, dict))
        tests = json.loads(tests) if isinstance(tests, str) else tests
        testtype, fn_name = tests.get("testtype"), tests.get("fn_name") or None
        inputs, outputs = list(tests.get("inputs") or []), list(tests.get("outputs") or [])
        source_id = str(record.get("question_id", record.get("idx", index)))
        starter = ""
    else:
        problem = nonempty(field(record, "question_content"), "question_content")
        source_id = str(field(record, "question_id", (str, int)))
        starter = str(record.get("starter_code") or "").strip()
        meta = record.get("metadata") or "{}"
        meta = json.loads(meta) if isinstance(meta, str) else meta
        fn_name = (meta or {}).get("func_name") or None
        cases = _lcb_cases(record.get("private_test_cases") or "[]", "private_test_cases")
        if options.get("include_public", False) or not cases:
            cases = _lcb_cases(record.get("public_test_cases") or "[]", "public_test_cases") + cases
        if not cases:
            raise BadRow("the problem has no test cases")
        kinds = {c.get("testtype") for c in cases if isinstance(c, dict)}
        if len(kinds) != 1 or not all(isinstance(c, dict) and "input" in c and "output" in c for c in cases):
            raise BadRow(f"test cases must be objects with input, output and one shared testtype, got types {kinds}")
        testtype = kinds.pop()
        inputs, outputs = [str(c["input"]) for c in cases], [str(c["output"]) for c in cases]
    if testtype not in ("stdin", "functional"):
        raise BadRow(f"testtype must be stdin or functional, got {testtype!r}")
    if not inputs or len(inputs) != len(outputs):
        raise BadRow(f"need as many outputs as inputs (got {len(inputs)} / {len(outputs)})")
    if options["_split"] == "train":
        inputs, outputs = _half_of_tests(
            inputs,
            outputs,
            seed=options.get("test_seed", 0),
            key=source_id,
            fraction=options.get("train_test_fraction", 0.5),
        )
    try:
        suite = TestSuite(
            testtype=testtype,
            inputs=inputs,
            outputs=outputs,
            fn_name=fn_name,
            time_limit=float(options.get("time_limit", 6.0)),
        )
    except (TypeError, ValueError) as exc:
        raise BadRow(str(exc)) from None
    text = f"{CODE_INSTRUCTION}\n\n### Problem\n{problem}"
    if testtype == "stdin":
        text += "\n\nRead the input from standard input and print the answer to standard output."
    if starter:
        text += f"\n\nStart from this code (keep the class and method names):\n```python\n{starter}\n```"
    metadata = {
        "question_id": source_id,
        "platform": record.get("platform"),
        "difficulty": record.get("difficulty"),
        "contest_date": str(record.get("contest_date")) if record.get("contest_date") else None,
        "num_tests": len(inputs),
        "split": options["_split"],
    }
    return make_row(
        prompt_id=f"livecodebench-{source_id}",
        messages=[{"role": "user", "content": text}],
        label=suite_to_label(suite),
        data_source="livecodebench",
        metadata=metadata,
    )
