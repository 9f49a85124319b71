"""The generated code tasks (tasks/data/easy_code.py): labels the code verifier reads, with the
reference function's outputs, the same for a seed, and held-out questions never trained on."""

from __future__ import annotations

import json

import pytest

from sdpo_core.verifiers.code import parse_tests
from tasks.data.easy_code import FAMILIES, make_splits, task_row


def test_every_question_has_a_functional_label_of_its_reference_outputs():
    train, held_out = make_splits(seed=0, eval_fraction=0.25)
    rows = train + held_out
    assert len(rows) == sum(len(f.names) * len(f.parameters) for f in FAMILIES.values())
    for row in rows:
        suite = parse_tests(row["label"])
        assert suite.testtype == "functional" and len(suite.inputs) == 5
        label = json.loads(row["label"])
        assert f"`{label['fn_name']}(" in row["prompt_messages"][0]["content"]
    count = task_row("vowels", 0, 0)
    label = json.loads(count["label"])
    for given, expected in zip(label["inputs"], label["outputs"], strict=True):
        word = json.loads(given)
        assert json.loads(expected) == sum(c in "aeiou" for c in word)
    above = json.loads(task_row("count_above", 1, 4)["label"])
    assert above["fn_name"] == "how_many_over_4"
    for given, expected in zip(above["inputs"], above["outputs"], strict=True):
        assert json.loads(expected) == sum(x > 4 for x in json.loads(given))


def test_splits_are_seeded_and_disjoint_and_a_question_keeps_its_tests():
    a_train, a_eval = make_splits(seed=1, eval_fraction=0.25)
    b_train, b_eval = make_splits(seed=1, eval_fraction=0.25)
    assert (a_train, a_eval) == (b_train, b_eval)
    assert not {r["prompt_id"] for r in a_train} & {r["prompt_id"] for r in a_eval}
    other_train, other_eval = make_splits(seed=2, eval_fraction=0.25)
    assert [r["prompt_id"] for r in other_eval] != [r["prompt_id"] for r in a_eval]
    labels = {r["prompt_id"]: r["label"] for r in a_train + a_eval}
    assert all(labels[r["prompt_id"]] == r["label"] for r in other_train + other_eval)
    with pytest.raises(ValueError, match="eval_fraction"):
        make_splits(seed=0, eval_fraction=1.0)
