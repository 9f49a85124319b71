"""An SRPO iteration end to end on the tiny config: the teacher stage decides each sample's route and
stores the teacher's entropies, the trainer applies the routed loss, and the metrics say how."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.integration.runs import TINY, write_config


def test_an_srpo_iteration_routes_samples_stores_entropies_and_logs_its_metrics(tmp_path, prefect_server):
    from flows.run import sdpo_run
    from storage.layout import RunLayout
    from storage.shard_reader import read_stage_columns

    base = {**TINY, "iterations": 1}
    # a base model that answers some of these easy sums, so groups hold both outcomes
    base["model"] = {"bootstrap": {**TINY["model"]["bootstrap"], "warmup_steps": 150}}
    base["data"] = {**TINY["data"], "max_operand": 3}
    config = write_config(
        tmp_path,
        "srpo",
        base=base,
        loss={"type": "srpo", "pass_rate_weight": True, "aggregation": "token-mean"},
        train={"steps_per_iteration": 1},
        eval={"enabled": False, "every": 0},
    )
    summary = sdpo_run(str(config), [])
    metrics = summary["iterations"]["1"]
    cols = read_stage_columns(RunLayout(str(tmp_path / "runs"), "srpo"), 1, "teacher")
    rewards = np.asarray(cols["reward"], dtype=np.float64)
    routes, sources = list(cols["route"]), list(cols["teacher_source"])

    # the paper's rule: failed (reward < 0.5) and shown a successful sibling -> SDPO, else GRPO
    expected = ["sdpo" if r < 0.5 and "solution" in s else "grpo" for r, s in zip(rewards, sources, strict=True)]
    assert routes == expected
    assert {"sdpo", "grpo"} <= set(routes), f"the base model should give mixed groups, got rewards {rewards}"
    assert all(m for m, r in zip(cols["sample_mask"], routes, strict=True) if r == "sdpo")
    groups = np.asarray(cols["group_id"])
    for i, g in enumerate(groups):
        assert cols["pass_rate"][i] == pytest.approx(np.mean(rewards[groups == g] >= 0.5))

    vocab_bound = math.log(200)  # the demo tokenizer has fewer ids
    for response, entropy in zip(cols["response_ids"], cols["teacher_entropy"], strict=True):
        assert len(entropy) == len(response) and entropy.dtype == np.float32
        assert np.isfinite(entropy).all() and (entropy >= 0).all() and (entropy < vocab_bound).all()
    flat = np.concatenate(cols["teacher_entropy"])
    assert metrics["teacher/entropy_mean"] == pytest.approx(float(flat.mean()), rel=1e-5)

    share = routes.count("sdpo") / len(routes)
    assert metrics["srpo/routed_sdpo_share"] == pytest.approx(share)
    assert metrics["srpo/routed_grpo_share"] == pytest.approx(1 - share)
    assert (
        metrics["srpo/entropy_weight_p10"] <= metrics["srpo/entropy_weight_p50"] <= metrics["srpo/entropy_weight_p90"]
    )
    # one optimizer step over the whole iteration: the trainer's weights have mean 1, as the stage's
    assert metrics["srpo/entropy_weight_mean"] == pytest.approx(1.0, rel=1e-5)
    assert metrics["sdpo/question_weight_mean"] == pytest.approx(1.0, rel=1e-5)
    assert metrics["sdpo/active_sample_fraction"] == pytest.approx(share)
    assert metrics["sdpo/loss"] + metrics["grpo/loss"] == pytest.approx(metrics["loss/total"], abs=1e-6)
    assert math.isfinite(metrics["train/grad_norm"]) and metrics["train/grad_norm"] > 0
