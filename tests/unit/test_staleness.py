"""pipeline.max_staleness: which checkpoint iteration n samples from and which teacher scores it."""

from __future__ import annotations

import pytest

from storage.layout import RunLayout
from tasks.config import ConfigError, load_config
from tasks.runtime import Run, behaviour_iteration, teacher_checkpoint


def run_with(*overrides: str) -> Run:
    cfg = load_config(None, ["storage.root=memory://staleness", *overrides])
    return Run(layout=RunLayout(cfg.storage.root, cfg.name), cfg=cfg)


@pytest.mark.parametrize("k,expected", [(0, [0, 1, 2, 3, 4]), (1, [0, 0, 1, 2, 3]), (2, [0, 0, 0, 1, 2])])
def test_iteration_n_samples_from_checkpoint_n_minus_1_minus_k(k, expected):
    cfg = run_with(f"pipeline.max_staleness={k}").cfg
    assert [behaviour_iteration(cfg, n) for n in range(1, 6)] == expected


@pytest.mark.parametrize(
    "mode,k,expected",
    [
        ("ema", 0, [(0, "policy"), (1, "teacher"), (2, "teacher")]),
        ("ema", 1, [(0, "policy"), (0, "policy"), (1, "teacher")]),
        ("live", 0, [(0, "policy"), (1, "policy"), (2, "policy")]),
        ("live", 1, [(0, "policy"), (0, "policy"), (1, "policy")]),
        ("trust-region", 1, [(0, "policy"), (0, "policy"), (1, "policy")]),
        ("static", 1, [(0, "policy"), (0, "policy"), (0, "policy")]),
    ],
)
def test_the_teacher_is_pinned_to_the_behaviour_policys_iteration(mode, k, expected):
    run = run_with(f"teacher.update={mode}", f"pipeline.max_staleness={k}")
    assert [teacher_checkpoint(run, n) for n in (1, 2, 3)] == expected


def test_staleness_is_a_non_negative_integer():
    with pytest.raises(ConfigError, match="pipeline.max_staleness"):
        load_config(None, ["pipeline.max_staleness=-1"])
