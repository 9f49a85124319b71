"""pass@k against counting the draws, avg@n, per-source metrics and the compare tables."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest

from sdpo_core.evaluation import accuracy_metrics, k_values, pass_at_k


def brute_pass_at_k(answers: list[bool], k: int) -> Fraction:
    """The fraction of all k-subsets of the answers that hold a correct one."""
    draws = list(itertools.combinations(range(len(answers)), k))
    return Fraction(sum(any(answers[i] for i in draw) for draw in draws), len(draws))


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_equals_the_fraction_of_k_subsets_with_a_correct_answer(n):
    for c in range(n + 1):
        answers = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(float(brute_pass_at_k(answers, k)), abs=1e-12)


def test_pass_at_1_is_the_sample_accuracy_and_pass_at_n_is_any_correct():
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    assert pass_at_k(8, 1, 8) == 1.0
    assert pass_at_k(8, 0, 8) == 0.0


def test_pass_at_k_refuses_k_beyond_the_samples_drawn_and_impossible_counts():
    with pytest.raises(ValueError, match=r"1 <= k <= n .* n=4, k=5"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match=r"0 <= c <= n; got n=4, c=5"):
        pass_at_k(4, 5, 1)


def test_k_values_are_powers_of_two_up_to_n():
    assert k_values(1) == (1,)
    assert k_values(4) == (1, 2, 4)
    assert k_values(6) == (1, 2, 4, 6)


def test_accuracy_metrics_of_two_prompts():
    metrics = accuracy_metrics(
        greedy_correct=[True, False],
        greedy_lengths=[3, 5],
        sampled_correct=[[True, False, False, False], [False, False, False, False]],
        sampled_lengths=[[1, 2, 3, 4], [4, 4, 4, 4]],
        prefix="eval/",
    )
    assert metrics == pytest.approx(
        {
            "eval/greedy_accuracy": 0.5,
            "eval/avg_at_4": 1 / 8,
            "eval/pass_at_1": 1 / 8,
            "eval/pass_at_2": (1 - 3 / 6) / 2,  # one correct of 4: 3 of the 6 pairs miss it
            "eval/pass_at_4": 0.5,
            "eval/response_length_mean": 4.0,
            "eval/sampled_response_length_mean": 3.25,
            "eval/prompts": 2.0,
        }
    )


def test_accuracy_metrics_refuses_ragged_groups():
    with pytest.raises(ValueError, match=r"same number of sampled answers; got group sizes \[1, 2\]"):
        accuracy_metrics(
            greedy_correct=[True, True],
            greedy_lengths=[1, 1],
            sampled_correct=[[True], [True, False]],
            sampled_lengths=[[1], [1, 1]],
            prefix="eval/",
        )


def columns(rows: list[tuple[int, float, int, str]]) -> dict[str, list]:
    return {
        "group_id": [r[0] for r in rows],
        "reward": [r[1] for r in rows],
        "response_ids": [[0] * r[2] for r in rows],
        "data_source": [r[3] for r in rows],
    }


def test_accuracy_by_source_reports_each_source_of_a_mixed_split():
    from tasks.evaluate import accuracy_by_source

    greedy = columns([(0, 1.0, 2, "math"), (1, 0.0, 4, "mcq"), (2, 1.0, 6, "mcq")])
    sampled = columns(
        [(0, 1.0, 1, "math"), (0, 1.0, 1, "math"), (1, 0.0, 1, "mcq"), (1, 0.5, 1, "mcq")]
        + [(2, 1.0, 1, "mcq"), (2, 0.0, 1, "mcq")]
    )
    metrics = accuracy_by_source(greedy, sampled, n=2)
    assert metrics["eval/greedy_accuracy"] == pytest.approx(2 / 3)
    assert metrics["eval/math/greedy_accuracy"] == 1.0
    assert metrics["eval/mcq/greedy_accuracy"] == 0.5
    assert metrics["eval/mcq/avg_at_2"] == 0.25  # a reward of 0.5 is not correct
    assert metrics["eval/mcq/pass_at_2"] == 0.5
    assert metrics["eval/pass_at_2"] == pytest.approx(2 / 3)
    assert metrics["eval/mcq/response_length_mean"] == 5.0


def test_accuracy_by_source_has_no_per_source_keys_for_one_source():
    from tasks.evaluate import accuracy_by_source

    greedy = columns([(0, 1.0, 2, "arithmetic")])
    metrics = accuracy_by_source(greedy, columns([(0, 0.0, 1, "arithmetic")] * 3), n=3)
    assert all(key.count("/") == 1 for key in metrics)
    with pytest.raises(ValueError, match=r"expected 4 answers per prompt, got group sizes \[3\]"):
        accuracy_by_source(greedy, columns([(0, 0.0, 1, "arithmetic")] * 3), n=4)


def test_compare_tables_put_runs_side_by_side():
    from tasks.tracking.compare import RunHistory, accuracy_rows, summary_rows

    a = RunHistory("a", "file:///runs/a", {"loss": {"type": "sdpo"}, "seed": 1})
    a.evals = {0: {"eval/greedy_accuracy": 0.1}, 2: {"eval/greedy_accuracy": 0.6, "eval/pass_at_2": 0.7}}
    a.iterations = {1: {"rollout/response_length_mean": 9.0}, 2: {"rollout/response_length_mean": 7.0}}
    a.seconds = {0: 1.0, 1: 3.0, 2: 6.0}
    b = RunHistory("b", "file:///runs/b", {"loss": {"type": "grpo"}, "seed": 1})
    b.evals = {0: {"eval/greedy_accuracy": 0.1}, 1: {"eval/greedy_accuracy": 0.3}}
    b.iterations = {1: {"rollout/response_length_mean": 8.0}}
    b.seconds = {0: 1.0, 1: 2.5}
    header, rows = summary_rows([a, b])
    assert header == ["metric", "a", "b"]
    table = {row[0]: row[1:] for row in rows}
    assert table["loss"] == ["sdpo", "grpo"] and table["iterations"] == ["2", "1"]
    assert table["greedy base"] == ["0.100", "0.100"] and table["greedy final"] == ["0.600", "0.300"]
    assert table["greedy best (at)"] == ["0.600 (2)", "0.300 (1)"]
    assert table["pass@2"] == ["0.700", "-"]
    assert table["rollout length"] == ["7.0", "8.0"] and table["seconds"] == ["6.0", "2.5"]
    header, rows = accuracy_rows([a, b])
    assert header == ["iteration", "a", "b"]
    assert rows == [["0", "0.100", "0.100"], ["1", "-", "0.300"], ["2", "0.600", "-"]]
