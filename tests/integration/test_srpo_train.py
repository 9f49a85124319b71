"""The Megatron trainer applies SRPO's routes and the pass-rate weights from the shard columns alone,
and the step does not depend on how the mini-batch is cut into micro-batches."""

from __future__ import annotations

import copy

import pytest
import torch


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from tests.synthetic import write_training_inputs

    hf, _, columns = write_training_inputs(tmp_path_factory.mktemp("srpo_train"))
    columns = copy.deepcopy(columns)
    # every other taught sample routed to SDPO; questions of varied pass rates
    columns["route"] = ["sdpo" if m and i % 2 == 0 else "grpo" for i, m in enumerate(columns["sample_mask"])]
    columns["pass_rate"] = [(i % 5) / 4 for i in range(len(columns["sample_id"]))]
    return hf, columns


def one_step(hf, columns, **loss) -> tuple[dict, dict]:
    from tasks.config import build_config
    from tasks.megatron.trainer import MegatronTrainer

    micro = loss.pop("micro_batch_size", 16)
    cfg = build_config(
        {
            "iterations": 1,
            "data": {"prompts_per_iteration": 4},
            "rollout": {"group_size": 4},
            "train": {"steps_per_iteration": 1, "micro_batch_size": micro},
            "optimizer": {"lr": 1e-2},
            "loss": {"aggregation": "token-mean", **loss},
        }
    )
    trainer = MegatronTrainer(cfg, hf)
    metrics = trainer.train_iteration(columns, iteration=1)
    weights = {k: v.detach().clone() for k, v in trainer.model.module.state_dict().items() if k.endswith("weight")}
    return metrics, weights


def test_srpo_steps_do_not_depend_on_the_micro_batch_size(inputs):
    hf, columns = inputs
    srpo = {"type": "srpo", "pass_rate_weight": True}
    whole, w_whole = one_step(hf, columns, **srpo, micro_batch_size=16)
    split, w_split = one_step(hf, columns, **srpo, micro_batch_size=3)
    assert whole["train/loss"] == pytest.approx(split["train/loss"], rel=1e-5)
    assert whole["train/grad_norm"] == pytest.approx(split["train/grad_norm"], rel=1e-5)
    # Adam moves every weight by about lr = 1e-2: a wrong normaliser shows at that scale, while the
    # summation order of the micro-batches can shift a near-zero gradient's step by far less
    for name in w_whole:
        torch.testing.assert_close(w_split[name], w_whole[name], rtol=1e-4, atol=1e-4)
    taught = sum(r == "sdpo" for r in columns["route"])
    for metrics in (whole, split):
        # the weights are normalised over the whole mini-batch, so they average 1 over it
        assert metrics["srpo/entropy_weight_mean"] == pytest.approx(1.0, rel=1e-5)
        assert metrics["sdpo/question_weight_mean"] == pytest.approx(1.0, rel=1e-5)
        assert metrics["sdpo/active_sample_fraction"] == pytest.approx(taught / len(columns["route"]))
        assert metrics["sdpo/loss"] + metrics["grpo/loss"] == pytest.approx(metrics["loss/total"], rel=1e-5)


def test_an_srpo_step_with_every_sample_routed_to_grpo_is_the_grpo_step(inputs):
    hf, columns = inputs
    everything_grpo = {**columns, "route": ["grpo"] * len(columns["route"])}
    srpo, w_srpo = one_step(hf, everything_grpo, type="srpo")
    grpo, w_grpo = one_step(hf, everything_grpo, type="grpo")
    assert srpo["train/loss"] == pytest.approx(grpo["train/loss"], rel=1e-6)
    for name in w_grpo:
        torch.testing.assert_close(w_srpo[name], w_grpo[name], rtol=1e-6, atol=1e-7)
    routed, _ = one_step(hf, columns, type="srpo")  # the routes of the columns change the step
    assert routed["train/grad_norm"] != pytest.approx(srpo["train/grad_norm"], rel=1e-3)
