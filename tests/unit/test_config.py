import subprocess
import sys

import pytest

from tasks.config import ConfigError, apply_overrides, config_hash, flatten, load_config


def write(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_defaults_follow_the_paper_code():
    cfg = load_config(None)
    assert cfg.loss.alpha == 0.5
    assert cfg.loss.divergence == "topk_tail"
    assert cfg.loss.is_clip == 2.0
    assert cfg.loss.mask_reduction == "dilute"
    assert cfg.teacher.update == "ema" and cfg.teacher.update_rate == 0.05
    assert cfg.rollout.group_size == 8


def test_yaml_and_dotted_overrides_compose(tmp_path):
    path = write(tmp_path, "name: r1\nloss:\n  alpha: 0.25\nrollout:\n  group_size: 4\n")
    cfg = load_config(path, ["loss.alpha=0.75", "rollout.top_k=8", "loss.is_clip=null"])
    assert cfg.name == "r1"
    assert cfg.loss.alpha == 0.75
    assert cfg.rollout.group_size == 4
    assert cfg.rollout.top_k == 8
    assert cfg.loss.is_clip is None


def test_unknown_key_names_the_field(tmp_path):
    path = write(tmp_path, "loss:\n  alhpa: 0.5\n")
    with pytest.raises(ConfigError, match=r"loss\.alhpa: unknown key"):
        load_config(path)


def test_sampled_token_requires_alpha_one():
    with pytest.raises(ConfigError, match=r"loss: .*sampled_token.*alpha=1"):
        load_config(None, ["loss.divergence=sampled_token"])
    cfg = load_config(None, ["loss.divergence=sampled_token", "loss.alpha=1"])
    assert cfg.loss.divergence == "sampled_token"


def test_sdpo_with_group_size_one_fails_with_the_fix():
    with pytest.raises(ConfigError, match=r"group_size >= 2"):
        load_config(None, ["rollout.group_size=1", "data.prompts_per_iteration=4"])
    # OPD has no peers to need
    cfg = load_config(None, ["rollout.group_size=1", "teacher.feedback=opd", "data.prompts_per_iteration=4"])
    assert cfg.rollout.group_size == 1


@pytest.mark.parametrize("k", [0, -3])
def test_top_k_below_one_is_rejected(k):
    with pytest.raises(ConfigError, match=r"rollout\.top_k: top_k=.*>= 1"):
        load_config(None, [f"rollout.top_k={k}"])


@pytest.mark.parametrize("rate", [0, -0.1, 1.1])
def test_ema_rate_outside_unit_interval_is_rejected(rate):
    with pytest.raises(ConfigError, match=r"teacher\.update_rate: .*outside \(0, 1\]"):
        load_config(None, [f"teacher.update_rate={rate}"])


def test_ema_rate_one_is_allowed():
    assert load_config(None, ["teacher.update_rate=1"]).teacher.update_rate == 1.0


def test_blend_needs_a_proper_lambda():
    with pytest.raises(ConfigError, match="blend_lambda"):
        load_config(None, ["loss.type=blend"])
    assert load_config(None, ["loss.type=blend", "loss.blend_lambda=0.3"]).loss.blend_lambda == 0.3


def test_steps_must_divide_the_iteration_batch():
    with pytest.raises(ConfigError, match="steps_per_iteration=3"):
        load_config(None, ["train.steps_per_iteration=3"])


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="section.key=value"):
        apply_overrides({}, ["loss.alpha"])


def test_config_hash_is_stable_and_sensitive():
    a = load_config(None)
    b = load_config(None)
    c = load_config(None, ["loss.alpha=0.3"])
    assert config_hash(a) == config_hash(b) != config_hash(c)


def test_flatten_uses_dotted_keys():
    assert flatten({"a": {"b": 1, "c": {"d": 2}}, "e": 3}) == {"a.b": 1, "a.c.d": 2, "e": 3}


def test_shipped_configs_validate():
    from pathlib import Path

    configs = sorted(Path(__file__).resolve().parents[2].joinpath("configs").glob("*.yaml"))
    assert configs, "no configs shipped"
    for path in configs:
        load_config(path)


def test_config_imports_without_torch():
    code = "import sys, tasks.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_model_path_and_preset_are_exclusive():
    with pytest.raises(ConfigError, match="model.path .* or model.preset"):
        load_config(None, ["model.path=/models/x", "model.preset=smollm2-135m-instruct"])


def test_a_bf16_embedded_engine_needs_the_gpu():
    with pytest.raises(ConfigError, match="rollout.dtype='bfloat16' samples in bf16 on a GPU"):
        load_config(None, ["rollout.dtype=bfloat16"])
    cfg = load_config(None, ["rollout.device=cuda", "rollout.dtype=bfloat16"])
    assert (cfg.rollout.device, cfg.rollout.dtype) == ("cuda", "bfloat16")


def test_sglang_rollouts_take_no_embedded_engine_placement():
    with pytest.raises(ConfigError, match="with engine='sglang' the servers decide"):
        load_config(None, ["rollout.engine=sglang", "rollout.sglang.urls=[http://h:1]", "rollout.device=cuda"])


def test_an_unknown_engine_device_names_the_field():
    with pytest.raises(ConfigError, match=r"rollout\.device: Input should be 'cpu' or 'cuda'"):
        load_config(None, ["rollout.device=gpu"])


def test_evaluation_can_be_switched_off_only_without_a_cadence_or_best_rule():
    cfg = load_config(None, ["eval.enabled=false", "eval.every=0"])
    assert cfg.eval.enabled is False
    with pytest.raises(ConfigError, match=r"eval: eval.enabled=false with eval.every=5: set eval.every=0"):
        load_config(None, ["eval.enabled=false"])
    with pytest.raises(ConfigError, match=r"storage.retention.weights.best='eval/greedy_accuracy' ranks"):
        load_config(None, ["eval.enabled=false", "eval.every=0", "storage.retention.weights.best=eval/greedy_accuracy"])


def test_eval_due_evaluates_the_base_the_cadence_and_the_last_unless_disabled():
    from flows.iteration import eval_due

    due = [n for n in range(6) if eval_due(n, enabled=True, every=2, last=5)]
    assert due == [0, 2, 4, 5]
    assert [n for n in range(7) if eval_due(n, enabled=True, every=0, last=5)] == [0, 5]
    assert not any(eval_due(n, enabled=False, every=0, last=5) for n in range(7))


def test_test_time_needs_a_baseline_at_least_as_long_as_the_attack():
    with pytest.raises(ConfigError, match="baseline_attempts >= max_attempts"):
        load_config(None, ["test_time.max_attempts=64", "test_time.baseline_attempts=32"])
    with pytest.raises(ConfigError, match="repeats a seed"):
        load_config(None, ["test_time.seeds=[1, 1]"])


def test_data_questions_must_be_distinct_and_name_existing_prompts():
    from tasks.data.prompts import training_rows

    with pytest.raises(ConfigError, match="distinct, non-empty prompt ids"):
        load_config(None, ["data.questions=[add-1-2, add-1-2]"])
    cfg = load_config(None, ["data.max_operand=9", "data.questions=[add-2-1, add-1-2]"])
    assert [r["prompt_id"] for r in training_rows(cfg.data, seed=cfg.seed)] == ["add-2-1", "add-1-2"]
    missing = load_config(None, ["data.max_operand=9", "data.questions=[add-99-1]"])
    with pytest.raises(ValueError, match=r"data.questions names prompt ids the data does not hold: \['add-99-1'\]"):
        training_rows(missing.data, seed=missing.seed)


def test_a_run_created_before_a_setting_existed_resumes_unless_the_setting_is_changed(tmp_path):
    """Settings added by a code upgrade take their defaults in runs created before them: opening
    such a run is no config change, while a real change (or a non-default new setting) still is."""
    import json

    from storage.errors import ConfigMismatchError
    from storage.layout import RunLayout
    from tasks.config import to_dict
    from tasks.runtime import start_run

    cfg = load_config(None, [f"storage.root={tmp_path}", "name=old"])
    layout = RunLayout(str(tmp_path), "old")
    start_run(cfg, layout)
    record = json.loads(layout.store.read_bytes(layout.run_json))
    del record["config"]["test_time"], record["config"]["data"]["questions"]  # as an older version wrote it
    layout.store.write_bytes(layout.run_json, json.dumps(record).encode())

    assert to_dict(start_run(cfg, layout).cfg) == to_dict(cfg)
    for changed in (["loss.alpha=1"], ["data.questions=[add-1-2]"]):
        with pytest.raises(ConfigMismatchError, match=changed[0].split("=")[0]):
            start_run(load_config(None, [f"storage.root={tmp_path}", "name=old", *changed]), layout)


def test_srpo_and_pass_rate_weights_are_selected_by_dotted_overrides(tmp_path):
    path = write(tmp_path, "loss:\n  type: srpo\n  srpo:\n    beta: 0.5\n")
    cfg = load_config(path, ["loss.srpo.route=failed_with_teacher", "loss.pass_rate_weight=true"])
    assert cfg.loss.type == "srpo" and cfg.loss.srpo.beta == 0.5
    assert cfg.loss.srpo.route == "failed_with_teacher" and cfg.loss.pass_rate_weight
    defaults = load_config(None, ["loss.type=srpo"]).loss
    assert defaults.srpo.route == "failed_with_solution" and defaults.srpo.beta == 1.0  # the paper's
    assert not load_config(None).loss.pass_rate_weight
    assert load_config(None, ["loss.type=blend", "loss.blend_lambda=0.9"]).loss.blend_lambda == 0.9


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["loss.type=srpo", "loss.srpo.beta=-1"], r"loss\.srpo\.beta: .*greater than or equal to 0"),
        (["loss.type=srpo", "loss.srpo.route=always"], r"loss\.srpo\.route: .*failed_with_solution"),
        (["loss.type=srpo", "loss.srpo.bogus=1"], r"loss\.srpo\.bogus: unknown key"),
        (
            ["loss.type=grpo", "loss.pass_rate_weight=true"],
            r"pass_rate_weight=true .* set loss\.pass_rate_weight=false",
        ),
        (["loss.type=srpo", "teacher.feedback=opd"], r"loss\.type='srpo' .* set teacher\.feedback=sdpo"),
        (["loss.type=srpo", "rollout.group_size=1", "data.prompts_per_iteration=4"], r"group_size >= 2"),
        (["loss.type=ppo"], r"loss\.type: .*'srpo'"),
    ],
)
def test_bad_srpo_and_pass_rate_settings_name_the_field_and_the_fix(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)
