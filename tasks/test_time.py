"""Test-time self-distillation: SDPO on single hard questions against best-of-k sampling.

A test-time run (`sdpo test-time CONFIG`) is an ordinary run whose iteration 0 holds the base model
and two stages of its own, each a JSON file committed with a manifest like any stage:

- `baseline`: the base model's `test_time.baseline_attempts` sampled answers to each screened
  question (the first `test_time.screen_prompts` held-out prompts, or the listed
  `test_time.questions`) and how many were correct. It picks the questions (the hardest, at most
  `test_time.max_base_success`) and gives best-of-k's unbiased discovery@k.
- `discovery`: written last, once every (question, seed) has been attacked: each attack's first
  success and the two discovery@k curves, `test_time` (updates on the question, with the run's
  `loss.type`) and `best_of_k` (the base model's samples), at the k of `attempt_grid`.

Each attack is a child run `<run>-<question>-s<seed>`: the same config with the base model taken
from the parent's checkpoint iter-0 (`model.path`), every iteration drawing the one question
(`data.questions`), `rollout.group_size` attempts per iteration, no evaluation. It stops after the
first iteration with a correct attempt, or after `test_time.max_attempts` attempts. Its outcome is
read back from its committed rollout shards, so a killed study resumes where it stopped and a
finished one is only read.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from collections.abc import Sequence
from typing import Any

from tasks.runtime import Run

logger = logging.getLogger(__name__)

BASELINE_FILE = "baseline.json"
DISCOVERY_FILE = "discovery.json"
SCREEN_CHUNK = 8  # prompts per sampling call of the screen: bounds the columns held at once


def screened_rows(run: Run) -> list[dict[str, Any]]:
    """The questions the base model is sampled on: the listed ones, or the first held-out prompts."""
    from tasks.data.prompts import load_splits, training_rows

    cfg = run.cfg
    if cfg.test_time.questions:
        return training_rows(cfg.data.model_copy(update={"questions": cfg.test_time.questions}), seed=cfg.seed)
    _, eval_rows = load_splits(cfg.data, seed=cfg.seed)
    return eval_rows[: cfg.test_time.screen_prompts]


def run_baseline(root: str, run_name: str) -> dict[str, Any]:
    """Stage `baseline` of iteration 0: the base model's attempts at every screened question."""
    from storage.faults import crash_point
    from storage.manifest import read_stage_manifest, stage_done
    from storage.stages import StageOutput
    from tasks.rollout import sample_groups
    from tasks.runtime import checkpoint_dir, open_run

    run = open_run(root, run_name)
    if stage_done(run.layout, 0, "baseline"):
        return read_stage_manifest(run.layout, 0, "baseline").data
    crash_point("stage.start:baseline", 0)
    cfg, n = run.cfg, run.cfg.test_time.baseline_attempts
    rows = screened_rows(run)
    policy = checkpoint_dir(run, 0, "policy")
    questions = []
    for start in range(0, len(rows), SCREEN_CHUNK):
        chunk = rows[start : start + SCREEN_CHUNK]
        cols, _ = sample_groups(
            run,
            rows=chunk,
            policy_dir=policy,
            n=n,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            seed=cfg.seed * 1_000_003 + start,
            iteration=0,
        )
        correct = [0] * len(chunk)
        for group_id, reward in zip(cols["group_id"], cols["reward"], strict=True):
            correct[int(group_id)] += int(float(reward) >= 1.0)
        for row, c in zip(chunk, correct, strict=True):
            prompt = row["prompt_messages"][-1]["content"]
            questions.append(
                {"prompt_id": row["prompt_id"], "prompt": prompt, "label": row["label"], "attempts": n, "correct": c}
            )
    output = StageOutput(run.layout, 0, "baseline")
    output.write_json(BASELINE_FILE, {"questions": questions})
    rates = [q["correct"] / n for q in questions]
    manifest = output.commit(
        metrics={"baseline/questions": len(questions), "baseline/success_rate_mean": sum(rates) / len(rates)}
    )
    return manifest.data


def read_baseline(run: Run) -> list[dict[str, Any]]:
    import json

    from storage.stages import read_stage_file

    return list(json.loads(read_stage_file(run.layout, 0, "baseline", BASELINE_FILE))["questions"])


def pick_questions(run: Run, baseline: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The listed questions, or the `num_questions` with the lowest base success rate (at most
    `max_base_success`; ties keep the screen's order). ValueError when none qualifies."""
    tt = run.cfg.test_time
    if tt.questions:
        return list(baseline)
    ranked = sorted(baseline, key=lambda q: q["correct"] / q["attempts"])  # stable: ties keep the order
    chosen = [q for q in ranked if q["correct"] / q["attempts"] <= tt.max_base_success][: tt.num_questions]
    if not chosen:
        easiest = min(q["correct"] / q["attempts"] for q in baseline)
        raise ValueError(
            f"no screened question has a base success rate <= test_time.max_base_success={tt.max_base_success} "
            f"(the lowest is {easiest:.3f}); raise it or screen more prompts (test_time.screen_prompts)"
        )
    return chosen


def attack_name(parent: str, prompt_id: str, seed: int) -> str:
    """The child run's name: parent, question id (characters outside [A-Za-z0-9._-] as '_'), seed;
    past the 128 characters a run's name may have, the id and seed are replaced by a digest of them
    (distinct questions and seeds keep distinct names)."""
    slug = re.sub(r"[^A-Za-z0-9._-]", "_", prompt_id)
    name = f"{parent}-{slug}-s{seed}"
    if len(name) <= 128:
        return name
    return f"{parent}-{hashlib.sha256(f'{prompt_id}/{seed}'.encode()).hexdigest()[:24]}"


def attack_config(cfg: Any, layout: Any, prompt_id: str, seed: int) -> dict[str, Any]:
    """The config tree of the child run attacking `prompt_id` with `seed` (parent config `cfg`,
    parent layout `layout`)."""
    from tasks.config import to_dict

    tree = to_dict(cfg)
    tree.pop("test_time")
    tree["storage"]["storage_options"] = cfg.storage.storage_options.as_fsspec()  # the same store
    tree["name"] = attack_name(cfg.name, prompt_id, seed)
    tree["seed"] = seed
    tree["iterations"] = math.ceil(cfg.test_time.max_attempts / cfg.rollout.group_size)
    tree["model"] = {**tree["model"], "path": layout.checkpoint_files_dir(0, "policy"), "preset": None}
    tree["data"] = {**tree["data"], "questions": [prompt_id], "prompts_per_iteration": 1}
    tree["eval"] = {**tree["eval"], "enabled": False, "every": 0}
    tree["tracking"] = {**tree["tracking"], "log_model": False, "register_model": None}
    return tree


def check_attacks(cfg: Any) -> None:
    """ConfigError, before anything is written, when the per-question runs this config implies are
    invalid (e.g. train.steps_per_iteration not dividing the rollout.group_size samples of one question)."""
    from tasks.config import ConfigError, build_config
    from tasks.runtime import run_layout

    try:
        build_config(attack_config(cfg, run_layout(cfg), "question", cfg.test_time.seeds[0]))
    except ConfigError as err:
        raise ConfigError(
            f"test_time: each question runs with data.prompts_per_iteration=1 and no evaluation, and that config "
            f"is invalid; change the settings it names:\n{err}"
        ) from None


def attack_outcome(run: Run) -> tuple[int | None, int]:
    """(first success as a 1-based attempt index or None, attempts made) from the child run's
    committed rollouts."""
    from sdpo_core.discovery import first_success
    from storage.manifest import read_latest
    from storage.shard_reader import read_stage_columns

    rewards = []
    for n in range(1, (read_latest(run.layout) or 0) + 1):
        rewards.append([float(r) for r in read_stage_columns(run.layout, n, "rollout", columns=["reward"])["reward"]])
        if first_success(rewards) is not None:
            break
    return first_success(rewards), sum(len(r) for r in rewards)


def run_discovery(run: Run, questions: Sequence[dict[str, Any]], attacks: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Stage `discovery` of iteration 0: the attacks' first successes and both discovery@k curves."""
    from sdpo_core.discovery import attempt_grid, best_of_k_discovery, discovery_at_k
    from storage.faults import crash_point
    from storage.manifest import read_stage_manifest, stage_done
    from storage.stages import StageOutput

    if stage_done(run.layout, 0, "discovery"):
        return read_discovery(run)
    crash_point("stage.start:discovery", 0)
    tt = run.cfg.test_time
    ks = attempt_grid(tt.max_attempts, run.cfg.rollout.group_size)
    updated = discovery_at_k([a["first_success"] for a in attacks], ks)
    best = best_of_k_discovery([q["correct"] for q in questions], n=tt.baseline_attempts, ks=ks)
    record = {
        "questions": list(questions),
        "attacks": list(attacks),
        "k": list(ks),
        "test_time": updated,
        "best_of_k": best,
        "loss": run.cfg.loss.type,
        "group_size": run.cfg.rollout.group_size,
    }
    output = StageOutput(run.layout, 0, "discovery")
    output.write_json(DISCOVERY_FILE, record)
    output.commit(
        parents=[read_stage_manifest(run.layout, 0, "baseline")],
        metrics={
            f"test_time/discovery_at_{ks[-1]}": updated[-1],
            f"test_time/best_of_k_at_{ks[-1]}": best[-1],
            "test_time/questions": len(questions),
            "test_time/attacks": len(attacks),
        },
    )
    return record


def read_discovery(run: Run) -> dict[str, Any]:
    import json

    from storage.stages import read_stage_file

    record: dict[str, Any] = json.loads(read_stage_file(run.layout, 0, "discovery", DISCOVERY_FILE))
    return record


def write_discovery_plot(record: dict[str, Any], path: Any) -> Any:
    """discovery@k against k: SDPO on the question and best-of-k sampling of the base model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tasks.tracking.compare import save_figure

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(record["k"], record["test_time"], marker="o", label=f"test-time {record['loss'].upper()} (on the question)")
    ax.plot(record["k"], record["best_of_k"], marker="s", label="best-of-k (base model)")
    ax.set_xlabel("attempts k")
    ax.set_ylabel("discovery@k")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    seeds = len(record["attacks"]) // len(record["questions"])
    ax.set_title(f"questions: {len(record['questions'])}, seeds per question: {seeds}")
    return save_figure(fig, path)
