"""discovery@k of test-time self-distillation and of best-of-k sampling (sdpo_core.discovery)."""

from __future__ import annotations

from math import comb

import pytest

from sdpo_core.discovery import attempt_grid, best_of_k_discovery, discovery_at_k, first_success


def test_first_success_counts_attempts_across_iterations_in_order():
    assert first_success([[0.0, 0.0], [0.0, 1.0, 1.0]]) == 4
    assert first_success([[1.0]]) == 1
    assert first_success([[0.0, 0.5], [0.9]]) is None
    assert first_success([[0.0, 0.5]], threshold=0.5) == 2
    assert first_success([]) is None


def test_discovery_at_k_is_the_fraction_found_by_attempt_k():
    firsts = [1, 5, None, 9]
    assert discovery_at_k(firsts, [1, 4, 5, 8, 9, 16]) == [0.25, 0.25, 0.5, 0.5, 0.75, 0.75]


@pytest.mark.parametrize("firsts,ks", [([], [1]), ([0], [1]), ([1], [0])])
def test_discovery_at_k_refuses_what_has_no_meaning(firsts, ks):
    with pytest.raises(ValueError):
        discovery_at_k(firsts, ks)


def test_best_of_k_is_the_mean_unbiased_pass_at_k():
    # one question with 1 correct of 4: pass@2 = 1 - C(3,2)/C(4,2) = 1/2; one with none: 0; one with all: 1
    assert best_of_k_discovery([1, 0, 4], n=4, ks=[1, 2, 4]) == pytest.approx(
        [(0.25 + 0 + 1) / 3, (0.5 + 0 + 1) / 3, (1 + 0 + 1) / 3]
    )
    n, c, k = 256, 3, 64
    assert best_of_k_discovery([c], n=n, ks=[k]) == pytest.approx([1 - comb(n - c, k) / comb(n, k)])


def test_attempt_grid_marks_every_iteration_and_the_budget():
    assert attempt_grid(64, 8) == (8, 16, 24, 32, 40, 48, 56, 64)
    assert attempt_grid(10, 4) == (4, 8, 10)
    assert attempt_grid(3, 8) == (3,)
    with pytest.raises(ValueError):
        attempt_grid(0, 8)
