"""The bootstrap warm-up's schedule is checked before anything is built or written."""

from __future__ import annotations

import pytest

from tasks.config import BootstrapConfig
from tasks.data.bootstrap import WarmupSchedule, bootstrap_checkpoint

DEFAULT_WARMUP_MIX = dict(BootstrapConfig().warmup_mix)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"steps": -1}, "steps >= 0"),
        ({"batch_size": 0}, "batch_size >= 1"),
        ({"lr": 0.0}, "lr > 0"),
        ({"mix": {"plain": 1.0, "hint": 1.0}}, "subset of"),
        ({"mix": {"plain": -0.5, "feedback": 1.0}}, "non-negative"),
        ({"mix": {"plain": 0.0, "solution": 0.0}}, "positive sum"),
    ],
)
def test_bad_schedules_are_rejected_naming_the_values(change, message):
    good = {"steps": 4, "batch_size": 2, "lr": 1e-3, "mix": dict(DEFAULT_WARMUP_MIX)}
    WarmupSchedule(**good)
    with pytest.raises(ValueError, match=message):
        WarmupSchedule(**{**good, **change})


def test_bootstrap_checkpoint_writes_nothing_for_a_bad_schedule(tmp_path):
    out = tmp_path / "base"
    with pytest.raises(ValueError, match="lr > 0"):
        bootstrap_checkpoint(
            out,
            train_rows=[{"prompt_id": "p", "prompt_messages": [{"role": "user", "content": "1+1="}], "label": "2"}],
            eval_rows=[],
            seed=0,
            steps=1,
            batch_size=1,
            lr=-1.0,
            architecture="qwen3",
            hidden=16,
            layers=1,
            heads=2,
            kv_heads=1,
            intermediate=16,
            max_positions=32,
            num_eval=0,
            mix=DEFAULT_WARMUP_MIX,
        )
    assert not out.exists()
