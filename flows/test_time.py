"""Test-time self-distillation as a Prefect flow (the paper's discovery@k on single hard questions).

base model -> baseline: the base model's attempts at the screened questions (best-of-k)
           -> pick the hardest questions
           -> for each question, for each seed: a child run of SDPO iterations on that question
              alone, until an attempt is correct or the attempt budget is spent
           -> discovery: first successes and the discovery@k curves (store, MLflow, Prefect)

Every step is a committed stage or an ordinary run, so a killed study resumes at the first
question and seed that is not done, and a finished one is only read back.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from prefect import flow

from flows.iteration import complete_iteration
from flows.orchestration import name_flow_run, quiet_libraries
from tasks import stages
from tasks.allocator import keep_freed_heap

logger = logging.getLogger(__name__)


def attack(parent: Any, parent_tracker: Any, question: dict[str, Any], seed: int) -> dict[str, Any]:
    """One question attacked with one seed: the child run iterated until its first success."""
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

    from storage.lock import RunLock
    from tasks.config import build_config
    from tasks.runtime import run_layout, start_run
    from tasks.test_time import attack_config, attack_outcome
    from tasks.tracking.experiment import open_tracker

    cfg = build_config(attack_config(parent.cfg, parent.layout, question["prompt_id"], seed))
    layout = run_layout(cfg)
    with RunLock(
        layout, lease_seconds=cfg.storage.lock_lease_seconds, heartbeat_seconds=cfg.storage.lock_lease_seconds / 4
    ):
        run = start_run(cfg.model_copy(update={"launch": parent.cfg.launch}), layout)
        found, made = attack_outcome(run)
        if found is None and made < cfg.iterations * cfg.rollout.group_size:
            tracker = open_tracker(run)
            if parent_tracker.enabled:
                tracker.set_tags(
                    {
                        MLFLOW_PARENT_RUN_ID: parent_tracker.run_id,
                        "sdpo.test_time_question": question["prompt_id"],
                    }
                )
            stages.prepare_base(cfg.storage.root, cfg.name)
            for n in range(cfg.iterations + 1):
                complete_iteration(run, tracker, n)
                found, made = attack_outcome(run)
                if found is not None:
                    break
            tracker.finish()
    where = f"found at attempt {found}" if found is not None else f"not found in {made} attempts"
    logger.info("%s: question %s, seed %d: %s", parent.cfg.name, question["prompt_id"], seed, where)
    return {"prompt_id": question["prompt_id"], "seed": seed, "run": cfg.name, "first_success": found, "attempts": made}


@flow(name="sdpo-test-time", log_prints=False)
def sdpo_test_time(
    config_path: str | None = None, overrides: list[str] | None = None, force_unlock: bool = False
) -> dict[str, Any]:
    """Test-time self-distillation on the hardest questions against best-of-k sampling.

    Args:
        config_path: YAML run config with a `test_time` section (relative to the working directory,
            SDPO_REPO_DIR on a worker).
        overrides: dotted overrides, e.g. ["test_time.max_attempts=32", "test_time.seeds=[0]"].
        force_unlock: take over a run lock whose lease expired and whose holder did not heartbeat.

    Returns:
        The discovery record: questions, each attack's first success, k and both discovery@k curves.
    """
    from storage.lock import RunLock
    from tasks.config import load_config, refuse_flow_overrides
    from tasks.preflight import preflight
    from tasks.runtime import run_layout, start_run
    from tasks.test_time import check_attacks, pick_questions, read_baseline, run_discovery, write_discovery_plot
    from tasks.tracking.experiment import open_tracker

    quiet_libraries()
    keep_freed_heap()  # a worker's flow run does not start in the CLI's main()
    cfg = load_config(config_path, overrides or [])
    # started from a deployment, the CLI's check of what Prefect stores did not run
    refuse_flow_overrides(overrides or [], config_path=config_path)
    preflight(cfg)
    check_attacks(cfg)
    layout = run_layout(cfg)
    name_flow_run(f"{cfg.name}/test-time")
    lease = cfg.storage.lock_lease_seconds
    with RunLock(layout, lease_seconds=lease, force=force_unlock, heartbeat_seconds=lease / 4):
        run = start_run(cfg, layout)
        tracker = open_tracker(run)
        stages.prepare_base(cfg.storage.root, cfg.name)
        tracker.log_step(0, stages.test_time_baseline(cfg.storage.root, cfg.name))
        questions = pick_questions(run, read_baseline(run))
        logger.info(
            "%s: %d question(s), base success %s",
            cfg.name,
            len(questions),
            ", ".join(f"{q['prompt_id']} {q['correct']}/{q['attempts']}" for q in questions),
        )
        attacks = [attack(run, tracker, q, seed) for q in questions for seed in cfg.test_time.seeds]
        record = run_discovery(run, questions, attacks)
        plot = write_discovery_plot(record, Path(cfg.storage.cache_dir) / "test_time" / f"{cfg.name}.png")
        tracker.log_artifact(plot)
        tracker.finish()
        publish_discovery(cfg.name, record)
    return record


def discovery_markdown(name: str, record: dict[str, Any]) -> str:
    """The discovery@k table and the attacks, as Markdown (Prefect artifact, CLI)."""
    method = f"test-time {record['loss'].upper()}"
    lines = [f"# {name}: discovery@k", "", f"| k | {method} | best-of-k |", "|---|---|---|"]
    lines += [
        f"| {k} | {s:.3f} | {b:.3f} |"
        for k, s, b in zip(record["k"], record["test_time"], record["best_of_k"], strict=True)
    ]
    lines += ["", "| question | seed | first success | base correct |", "|---|---|---|---|"]
    base = {q["prompt_id"]: f"{q['correct']}/{q['attempts']}" for q in record["questions"]}
    for a in record["attacks"]:
        found = "-" if a["first_success"] is None else str(a["first_success"])
        lines.append(f"| {a['prompt_id']} | {a['seed']} | {found} | {base[a['prompt_id']]} |")
    return "\n".join(lines)


def publish_discovery(name: str, record: dict[str, Any]) -> None:
    from flows.artifacts import artifact_key, markdown_artifact

    markdown_artifact(discovery_markdown(name, record), key=artifact_key(name, "discovery"))
