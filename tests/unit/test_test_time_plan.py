"""What a test-time study attacks and how: the questions picked from the screen, the child run's config."""

from __future__ import annotations

import pytest

from storage.layout import RunLayout
from tasks.config import ConfigError, build_config, load_config
from tasks.runtime import Run
from tasks.test_time import attack_config, attack_name, check_attacks, pick_questions

SCREEN = [
    {"prompt_id": "a", "correct": 5, "attempts": 100},
    {"prompt_id": "b", "correct": 0, "attempts": 100},
    {"prompt_id": "c", "correct": 60, "attempts": 100},
    {"prompt_id": "d", "correct": 0, "attempts": 100},
    {"prompt_id": "e", "correct": 2, "attempts": 100},
]


def plan(*overrides: str) -> Run:
    cfg = load_config(None, ["name=tt", "storage.root=memory://plan", *overrides])
    return Run(layout=RunLayout(cfg.storage.root, cfg.name), cfg=cfg)


def test_the_screen_picks_the_hardest_under_the_bound_in_screen_order_on_ties():
    picked = pick_questions(plan("test_time.num_questions=3", "test_time.max_base_success=0.05"), SCREEN)
    assert [q["prompt_id"] for q in picked] == ["b", "d", "e"]
    picked = pick_questions(plan("test_time.num_questions=9", "test_time.max_base_success=0.05"), SCREEN)
    assert [q["prompt_id"] for q in picked] == ["b", "d", "e", "a"]


def test_listed_questions_are_attacked_whatever_their_rate():
    run = plan("test_time.questions=[c]")
    assert pick_questions(run, [SCREEN[2]]) == [SCREEN[2]]


def test_no_question_under_the_bound_names_the_settings_to_change():
    with pytest.raises(ValueError, match=r"max_base_success=0.01 \(the lowest is 0.050\)"):
        pick_questions(plan("test_time.max_base_success=0.01"), [SCREEN[0], SCREEN[2]])


def test_the_child_run_trains_on_its_question_from_the_parent_base_without_evaluation():
    run = plan("rollout.group_size=8", "test_time.max_attempts=20", "train.steps_per_iteration=2")
    child = build_config(attack_config(run.cfg, run.layout, "add-3/4 x", 7))
    assert child.name == attack_name("tt", "add-3/4 x", 7) == "tt-add-3_4_x-s7"
    assert child.seed == 7 and child.iterations == 3  # ceil(20 / 8)
    assert child.model.path == run.layout.checkpoint_files_dir(0, "policy")
    assert child.data.questions == ["add-3/4 x"] and child.data.prompts_per_iteration == 1
    assert not child.eval.enabled and not child.tracking.log_model
    assert child.loss == run.cfg.loss and child.teacher == run.cfg.teacher and child.optimizer == run.cfg.optimizer


def test_a_config_whose_children_cannot_train_is_refused_with_the_field():
    with pytest.raises(ConfigError, match="train.steps_per_iteration=32"):
        check_attacks(plan("train.steps_per_iteration=32", "data.prompts_per_iteration=32", "rollout.group_size=8").cfg)
