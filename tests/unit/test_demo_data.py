import pytest

from tasks.data.demo import addition_row, make_splits


def test_row_schema_and_label():
    row = addition_row(37, 45)
    assert row == {
        "prompt_id": "add-37-45",
        "prompt_messages": [{"role": "user", "content": "37+45="}],
        "label": "82",
        "data_source": "arithmetic",
    }


def test_splits_are_deterministic_for_a_seed_and_differ_across_seeds():
    assert make_splits(seed=3, max_operand=20, eval_fraction=0.2) == make_splits(
        seed=3, max_operand=20, eval_fraction=0.2
    )
    assert make_splits(seed=3, max_operand=20, eval_fraction=0.2) != make_splits(
        seed=4, max_operand=20, eval_fraction=0.2
    )


def test_splits_cover_every_prompt_once_and_never_share_a_pair():
    train, held_out = make_splits(seed=0, max_operand=30, eval_fraction=0.1)
    ids = [r["prompt_id"] for r in train + held_out]
    assert len(ids) == len(set(ids)) == 31 * 31
    pair = lambda r: frozenset(map(int, r["prompt_messages"][0]["content"][:-1].split("+")))  # noqa: E731
    assert not {pair(r) for r in train} & {pair(r) for r in held_out}
    assert 0.07 < len(held_out) / len(ids) < 0.13


def test_labels_are_the_sums():
    train, held_out = make_splits(seed=1, max_operand=9, eval_fraction=0.3, min_operand=2)
    for row in train + held_out:
        a, b = row["prompt_messages"][0]["content"].rstrip("=").split("+")
        assert 2 <= int(a) <= 9 and 2 <= int(b) <= 9
        assert row["label"] == str(int(a) + int(b))


@pytest.mark.parametrize(
    "kwargs", [dict(max_operand=0), dict(max_operand=5, eval_fraction=1.0), dict(max_operand=5, min_operand=6)]
)
def test_bad_settings_are_rejected(kwargs):
    kwargs = {"eval_fraction": 0.1, **kwargs}
    with pytest.raises(ValueError):
        make_splits(seed=0, **kwargs)


def test_a_prompt_template_words_the_question_and_keeps_ids_labels_and_splits():
    question = "What is {a} + {b}? Reply with only the number."
    plain = make_splits(seed=2, max_operand=12, eval_fraction=0.2)
    worded = make_splits(seed=2, max_operand=12, eval_fraction=0.2, template=question)
    for plain_rows, worded_rows in zip(plain, worded, strict=True):
        assert [(r["prompt_id"], r["label"]) for r in plain_rows] == [(r["prompt_id"], r["label"]) for r in worded_rows]
    row = addition_row(7, 35, template=question)
    assert row["prompt_messages"] == [{"role": "user", "content": "What is 7 + 35? Reply with only the number."}]


@pytest.mark.parametrize("template", ["{a}+{a}=", "{a}+{b}={c}", "what is a plus b", "{a}+{b", "{0}+{1}="])
def test_a_template_without_exactly_the_two_operand_fields_is_rejected_by_the_config(template):
    from tasks.config import DataConfig

    with pytest.raises(ValueError, match="prompt_template"):
        DataConfig(prompt_template=template)
