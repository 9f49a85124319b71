"""The paper presets load and carry the paper's numbers, and dotted overrides still apply on top."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_the_no_feedback_preset_carries_the_papers_defaults():
    cfg = load_config(CONFIGS / "paper_no_feedback.yaml")
    assert cfg.rollout.top_k == 100 and cfg.loss.divergence == "topk_tail"  # top-100 + tail
    assert cfg.loss.type == "sdpo" and cfg.loss.alpha == 0.5  # Jensen-Shannon
    assert cfg.teacher.update == "ema" and cfg.teacher.update_rate == 0.05
    assert cfg.optimizer.lr == 1e-5 and cfg.optimizer.warmup_steps == 10
    assert cfg.loss.is_clip == 2.0 and cfg.loss.aggregation == "sequence-mean"
    assert (cfg.data.prompts_per_iteration, cfg.rollout.group_size, cfg.train.steps_per_iteration) == (32, 8, 1)
    assert cfg.teacher.feedback_kwargs["include_environment_feedback"] is False


def test_the_rich_feedback_preset_carries_the_papers_defaults():
    cfg = load_config(CONFIGS / "paper_rich_feedback.yaml")
    assert cfg.rollout.top_k == 20 and cfg.loss.divergence == "topk_tail"
    assert cfg.loss.alpha == 1.0  # reverse KL(student || teacher)
    assert cfg.teacher.update == "ema" and cfg.teacher.update_rate == 0.01
    assert cfg.optimizer.lr == 1e-6 and cfg.optimizer.warmup_steps == 0
    # a mini-batch of one prompt: 32 x 8 answers in 32 steps of 8
    assert (cfg.data.prompts_per_iteration, cfg.rollout.group_size, cfg.train.steps_per_iteration) == (32, 8, 32)
    assert cfg.teacher.feedback_kwargs["include_environment_feedback"] is True


@pytest.mark.parametrize("preset", ["paper_no_feedback.yaml", "paper_rich_feedback.yaml"])
def test_a_preset_takes_the_task_and_a_variant_as_overrides(preset):
    cfg = load_config(CONFIGS / preset, ["verifier.name=mcq", "loss.type=srpo", "loss.aggregation=token-mean"])
    assert cfg.verifier.name == "mcq" and cfg.loss.type == "srpo"
    assert cfg.optimizer.lr in (1e-5, 1e-6)  # the preset's numbers stay
