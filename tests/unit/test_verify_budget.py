"""The per-answer time budget around the pure verifiers (tasks/sandbox/budget.py)."""

from __future__ import annotations

import time

import pytest

from tasks.sandbox.budget import BudgetedVerifier, overrun_verdict

SYMBOLIC = "\\boxed{\\sqrt{2} \\cdot \\sqrt{2}}"  # the first symbolic answer imports sympy: ~1 s


@pytest.fixture
def budgeted():
    made = []

    def make(name, budget_s, **kwargs):
        made.append(BudgetedVerifier(name, kwargs, budget_s=budget_s))
        return made[-1]

    yield make
    for verifier in made:
        verifier.close()


def test_verdicts_match_the_verifier_run_in_process(budgeted):
    from sdpo_core.verifiers import math

    verify = budgeted("math", 30.0, reveal_answer=True)
    for text in ("\\boxed{42}", "\\boxed{41}", "no answer", SYMBOLIC):
        assert verify(text, "42" if "sqrt" not in text else "2", truncated=False) == math.verify(
            text, "42" if "sqrt" not in text else "2", truncated=False, reveal_answer=True
        )


def test_an_answer_over_the_budget_scores_zero_and_the_next_one_is_judged(budgeted):
    verify = budgeted("math", 0.05)
    started = time.monotonic()
    assert verify(SYMBOLIC, "2", truncated=False) == overrun_verdict(0.05)
    assert time.monotonic() - started < 1.0  # not the sympy import's ~1 s: the call was cut off
    assert verify("\\boxed{7}", "7", truncated=False).reward == 1.0  # a fresh worker


def test_a_malformed_label_still_raises(budgeted):
    with pytest.raises(ValueError, match="label"):
        budgeted("math", 5.0)("\\boxed{1}", "   ", truncated=False)


def test_the_rollout_stage_verifies_through_the_budget(monkeypatch):
    import tasks.rollout as rollout
    from tasks.config import load_config

    cfg = load_config(None, ["verifier.name=math", "verifier.time_budget_s=0.05"])
    monkeypatch.setattr(rollout, "_VERIFIERS", {})
    try:
        assert rollout.verify(cfg, SYMBOLIC, "2", truncated=False) == overrun_verdict(0.05)
        assert rollout.verify(cfg, "\\boxed{3}", "3", truncated=False).reward == 1.0
    finally:
        for verifier in rollout._VERIFIERS.values():
            verifier.close()
