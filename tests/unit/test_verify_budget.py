"""The per-answer time budget around the pure verifiers (tasks/sandbox/budget.py)."""

from __future__ import annotations

import sys
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
        assert rollout.verify_all(cfg, [(SYMBOLIC, "2", False)]) == [overrun_verdict(0.05)]
        assert rollout.verify_all(cfg, [("\\boxed{3}", "3", False)])[0].reward == 1.0
    finally:
        for verifier in rollout._VERIFIERS.values():
            verifier.close()


def test_many_answers_come_back_in_order_as_one_at_a_time(budgeted):
    verify = budgeted("math", 30.0)
    # long enough answers that the requests fill the pipe (64 KiB) before the worker drains it
    requests = [(f"{'x' * 2000} \\boxed{{{i % 7}}}", "3", i % 5 == 0) for i in range(200)]
    alone = budgeted("math", 30.0)
    one_by_one = [alone(text, label, truncated=cut) for text, label, cut in requests]
    assert sum(v.reward for v in one_by_one) > 0 and any(v.truncated for v in one_by_one)
    assert verify.many(requests) == one_by_one
    assert verify.many(requests[:3]) == one_by_one[:3]  # the worker is in step for the next batch


def test_an_overrun_inside_a_batch_scores_zero_and_the_rest_are_judged_by_a_fresh_worker(budgeted):
    verify = budgeted("math", 0.05)
    verify("\\boxed{1}", "1", truncated=False)  # the worker is up
    first = verify._process.pid
    requests = [
        ("\\boxed{7}", "7", False),
        (SYMBOLIC, "2", False),
        ("\\boxed{7}", "7", False),
        ("\\boxed{6}", "7", False),
    ]
    verdicts = verify.many(requests)
    assert verdicts[1] == overrun_verdict(0.05)
    assert [v.reward for v in verdicts] == [1.0, 0.0, 1.0, 0.0]
    assert verify._process.pid != first


def test_a_malformed_label_inside_a_batch_raises_and_the_next_batch_is_judged_alone(budgeted):
    verify = budgeted("math", 5.0)
    with pytest.raises(ValueError, match="label"):
        verify.many([("\\boxed{1}", "1", False), ("\\boxed{1}", "   ", False), ("\\boxed{2}", "2", False)])
    # nothing of the failed batch is left in the pipe to be read as these answers
    assert [v.reward for v in verify.many([("\\boxed{5}", "4", False), ("\\boxed{4}", "4", False)])] == [0.0, 1.0]


def test_an_interrupt_while_answers_are_read_stops_the_worker_and_returns(budgeted):
    import threading

    verify = budgeted("math", 30.0)
    verify("\\boxed{1}", "1", truncated=False)
    read = verify._answer
    calls = []

    def interrupted(timeout):
        calls.append(timeout)
        if len(calls) > 3:
            raise KeyboardInterrupt
        return read(timeout)

    verify._answer = interrupted
    # 2,000 answers of 2 kB: far more than the pipes hold, so the request writer is blocked when it comes
    requests = [("x" * 2000 + " \\boxed{3}", "3", False)] * 2000
    raised = []

    def judge():
        try:
            verify.many(requests)
        except KeyboardInterrupt:
            raised.append(True)

    caller = threading.Thread(target=judge, daemon=True)
    caller.start()
    caller.join(timeout=20)
    assert not caller.is_alive() and raised == [True]
    assert verify._process is None and verify._writer is None
    verify._answer = read
    assert [v.reward for v in verify.many([("\\boxed{3}", "3", False)])] == [1.0]


BUGGY_MATH = """
import os
import sdpo_core.verifiers as verifiers

_real = verifiers.VERIFIERS["math"]


def _buggy(text, label, *, truncated, **kwargs):
    if not truncated and "overflow" in text:
        raise OverflowError("int too large to convert to float")
    if not truncated and "valueerror" in text:
        raise ValueError("Exceeds the limit (4300 digits) for integer string conversion")
    if not truncated and "crash" in text:
        os._exit(3)
    if "chatty" in text:
        print("a stray debug line")
    return _real(text, label, truncated=truncated, **kwargs)


verifiers.VERIFIERS["math"] = _buggy
"""


@pytest.fixture
def buggy_math(tmp_path, monkeypatch):
    """The math verifier, in the worker only, with a bug on some answers (raises, or kills the worker)."""
    import os

    (tmp_path / "sitecustomize.py").write_text(BUGGY_MATH)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))


def test_a_verifier_bug_on_one_answer_costs_that_answer_only(budgeted, buggy_math):
    verify = budgeted("math", 30.0)
    requests = [
        ("\\boxed{1}", "1", False),
        ("overflow", "1", False),
        ("valueerror", "1", False),  # a ValueError on an answer is no label error: the label is fine
        ("crash", "1", False),
        ("\\boxed{2}", "2", False),
        ("chatty \\boxed{3}", "3", False),  # a print in the verifier is no answer line
        ("\\boxed{3}", "4", False),
    ]
    verdicts = verify.many(requests)
    assert [v.reward for v in verdicts] == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    assert "OverflowError" in verdicts[1].feedback and "could not be checked" in verdicts[1].feedback
    assert "ValueError" in verdicts[2].feedback
    assert "exit status 3" in verdicts[3].feedback
    with pytest.raises(ValueError, match="label"):  # a malformed label still stops the batch
        verify.many([("overflow", "   ", False)])
