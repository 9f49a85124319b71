"""Bad and hostile run configs fail while loading, naming the file, line and field (never a secret)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tasks.config import ConfigError, load_config

SECRET = "SENTINEL-9f3b7e1c"


def write(tmp_path: Path, text: str | bytes, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


@pytest.mark.parametrize(
    "override",
    [
        "optimizer.lr=.inf",
        "optimizer.lr=.nan",
        "loss.clip_low=-.inf",
        "teacher.update_rate=.nan",
        "rollout.temperature=.inf",
    ],
)
def test_non_finite_numbers_are_refused(override):
    with pytest.raises(ConfigError, match=rf"override 1: {override.split('=')[0]}: .*finite"):
        load_config(None, [override])


def test_betas_must_be_in_range():
    with pytest.raises(ConfigError, match=r"optimizer.betas: betas=\[0.9, 1.5\]"):
        load_config(None, ["optimizer.betas=[0.9, 1.5]"])


def test_a_field_error_names_the_file_and_line(tmp_path):
    path = write(tmp_path, "name: x\noptimizer:\n  weight_decay: 0.1\n  lr: .inf\n")
    with pytest.raises(ConfigError, match=rf"{path}:4: optimizer.lr: .*finite"):
        load_config(path)


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("arithmetic", "{foo: 1}", r"\['foo'\] are not arguments of the 'arithmetic' verifier; it takes \[\]"),
        (
            "math",
            "{allow_last_numbr: true}",
            r"\['allow_last_numbr'\] .* 'math' .* \['allow_last_number', 'reveal_answer'\]",
        ),
        ("code", "{memory: 512}", r"\['memory'\] .* 'code' verifier; it takes \[.*'memory_mb'"),
        ("code", "{isolation: chroot}", r"isolation='chroot': Input should be 'auto', 'namespace' or 'process'"),
        ("code", "{nproc: 1}", r"nproc must be in \[3, 4096\], got 1"),
    ],
)
def test_verifier_kwargs_are_checked_against_the_verifier(tmp_path, name, kwargs, message):
    path = write(tmp_path, f"verifier:\n  name: {name}\n  kwargs: {kwargs}\n")
    with pytest.raises(ConfigError, match=rf"{path}:3: verifier.kwargs: .*{message}"):
        load_config(path)


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("code", "{total_s: .inf}", r"total_s=inf: Input should be a finite number"),
        ("code", "{per_test_s: .inf}", r"per_test_s=inf: Input should be a finite number"),
        ("code", "{per_test_s: .nan}", r"per_test_s=nan: Input should be a finite number"),
        ("code", "{nproc: 2.5}", r"nproc=2.5: Input should be a valid integer"),
        ("code", "{nproc: true}", r"nproc=True: Input should be a valid integer"),
        ("code", "{memory_mb: '512'}", r"memory_mb='512': Input should be a valid integer"),
        ("code", "{partial_credit: maybe}", r"partial_credit='maybe': Input should be a valid boolean"),
        ("code", "{python_guard: 'no'}", r"python_guard='no': Input should be a valid boolean"),
        ("code", "{total_s: 100000.0}", r"total_s must be in \(0, 86400\] seconds, got 100000.0"),
        ("code", "{nofile: 100000000}", r"nofile must be in \[16, 1048576\], got 100000000"),
        ("math", "{allow_last_number: maybe}", r"allow_last_number='maybe': Input should be a valid boolean"),
        ("mcq", "{letters: 5}", r"letters=5: Input should be a valid string"),
        ("tooluse", "{detailed_feedback: 1}", r"detailed_feedback=1: Input should be a valid boolean"),
    ],
)
def test_verifier_kwargs_are_typed_finite_and_in_range(tmp_path, name, kwargs, message):
    """Each of these passed the old check and then crashed every verification (or silently turned a
    switch on); now the config fails to load, naming the field."""
    path = write(tmp_path, f"verifier:\n  name: {name}\n  kwargs: {kwargs}\n")
    with pytest.raises(ConfigError, match=rf"{path}:3: verifier.kwargs: .*{message}"):
        load_config(path)


def test_the_verifiers_own_kwargs_pass():
    load_config(None, ["verifier.name=math", "verifier.kwargs={allow_last_number: true}"])
    load_config(
        None, ["verifier.name=code", "verifier.kwargs={partial_credit: true, isolation: process, memory_mb: 512}"]
    )


def test_malformed_yaml_names_the_file_and_line(tmp_path):
    path = write(tmp_path, "name: x\nloss:\n  alpha: [0.5\n  type: sdpo\n")
    with pytest.raises(ConfigError, match=rf"^{path}:\d+: not valid YAML"):
        load_config(path)


def test_non_utf8_config_names_the_file(tmp_path):
    path = write(tmp_path, b"name: caf\xe9\n")
    with pytest.raises(ConfigError, match=rf"^{path}: not UTF-8 text"):
        load_config(path)


@pytest.mark.parametrize(
    ("text", "where", "key", "lines"),
    [
        ("name: x\nseed: 1\niterations: 2\nseed: 7\n", 4, "seed", (2, 4)),
        ("name: x\nloss:\n  alpha: 0.5\n  type: sdpo\n  alpha: 1.0\n", 5, "loss.alpha", (3, 5)),
        ("loss:\n  alpha: 0.5\noptimizer:\n  lr: 1.0e-3\nloss:\n  type: grpo\n", 5, "loss", (1, 5)),
    ],
)
def test_a_key_given_twice_is_refused_with_both_lines(tmp_path, text, where, key, lines):
    """YAML keeps the last of two equal keys without a word; a config that says two things is refused."""
    path = write(tmp_path, text)
    with pytest.raises(
        ConfigError, match=rf"^{path}:{where}: {key} is given twice \(lines {lines[0]} and {lines[1]}\)"
    ):
        load_config(path)


@pytest.mark.parametrize(
    "override",
    [
        f"storage.storage_options.secret={SECRET}",
        f"storage.storage_options.key={SECRET}",
        f"storage.storage_options.client_kwargs.aws_secret_access_key={SECRET}",
        f"storage.storage_options.password={SECRET}",
        f"tracking.uri=https://user:{SECRET}@mlflow.example/",
        f"teacher.feedback_kwargs.api_key={SECRET}",
        f"model.chat_template_kwargs.hf_token={SECRET}",
    ],
)
def test_credentials_in_overrides_are_refused_without_showing_them(override):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert SECRET not in str(err.value)
    assert f"override 1 ({override.split('=')[0]})" in str(err.value)


def test_credentials_in_the_file_are_refused_with_the_line(tmp_path):
    path = write(
        tmp_path, f"name: x\nstorage:\n  storage_options:\n    endpoint_url: http://s3\n    secret: {SECRET}\n"
    )
    with pytest.raises(ConfigError, match=rf"^{path}:5: storage.storage_options.secret looks like a credential") as err:
        load_config(path)
    assert SECRET not in str(err.value)


def test_a_credential_never_appears_in_an_error_about_another_field(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"storage.aws_secret_access_key={SECRET}"])
    assert SECRET not in str(err.value)
    with pytest.raises(ConfigError) as err:  # an unknown key's value is not echoed either
        load_config(None, [f"storage.endpoint={SECRET}"])
    assert SECRET not in str(err.value) and "storage.endpoint: unknown key" in str(err.value)


# -- bad inputs refused with a clear error before anything is written ---------------------------
NESTINGS = {
    "a dotted key": lambda d: "model.chat_template_kwargs." + ".".join(["a"] * d) + "=1",
    "a flow list": lambda d: "model.chat_template_kwargs.x=" + "[" * d + "]" * d,
    "a flow mapping": lambda d: "model.chat_template_kwargs.x=" + "{a: " * d + "1" + "}" * d,
    "a block mapping": lambda d: "model.chat_template_kwargs.x=" + "".join(f"\n{' ' * i}a:" for i in range(d)) + " 1",
}


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(sorted(NESTINGS)), depth=st.integers(min_value=40, max_value=6000))
@example(kind="a dotted key", depth=900)
@example(kind="a flow list", depth=5000)
@example(kind="a flow mapping", depth=900)
def test_an_override_nested_past_any_config_is_refused_by_name(kind, depth):
    """900 or 5,000 levels used to end in a RecursionError traceback (YAML, JSON or pydantic)."""
    override = NESTINGS[kind](depth)
    source = r"^override 1 \(model\.chat_template_kwargs\.[a.x]{1,80}\): "
    with pytest.raises(ConfigError, match=source + r"(nested deeper than 32 levels|a key of \d+ levels).*at most 32$"):
        load_config(None, [override])


@settings(max_examples=20, deadline=None)
@given(depth=st.integers(min_value=40, max_value=3000), flow=st.booleans())
def test_a_file_nested_past_any_config_is_refused_by_name(tmp_path_factory, depth, flow):
    if flow:
        text = "model:\n  chat_template_kwargs:\n    x: " + "[" * depth + "]" * depth + "\n"
    else:
        text = "model:\n  chat_template_kwargs:\n" + "".join(" " * (i + 4) + "a:\n" for i in range(depth)) + "  b: 1\n"
    path = write(tmp_path_factory.mktemp("deep"), text)
    with pytest.raises(ConfigError, match=rf"^{path}.*nested deeper than 32 levels"):
        load_config(path)


def test_a_bad_yaml_value_in_an_override_names_it():
    with pytest.raises(ConfigError, match=r"^override 2 \(seed\): the value is not valid YAML"):
        load_config(None, ["iterations=2", "seed=["])


RUN_NAME = st.text(alphabet=st.sampled_from("abcXYZ019._-"), min_size=1, max_size=300)


@settings(max_examples=80, deadline=None)
@given(name=RUN_NAME)
@example(name="a" * 300)
@example(name="a" * 128)
@example(name="mlflow.db")
@example(name="mlartifacts")
@example(name="...")  # YAML's document end: refused as a value that is not YAML
def test_a_run_name_that_validates_makes_a_run(tmp_path_factory, name):
    """Every name `sdpo validate` accepts names a run folder, a layout and a test-time run's children;
    any other is refused by the config, naming the field (a 300-character name used to pass and then
    fail the run with a traceback)."""
    from storage.layout import RunLayout, create_or_open_run
    from tasks.test_time import attack_name

    try:
        cfg = load_config(None, [f"name={name}"])
    except ConfigError as err:
        assert "override 1: name: " in str(err) or "override 1 (name): " in str(err), err  # the field is named
        return
    root = tmp_path_factory.mktemp("names")
    layout = RunLayout(str(root), cfg.name)
    create_or_open_run(layout, {"name": cfg.name})
    assert (root / cfg.name / "run.json").is_file()
    assert cfg.name not in ("mlflow.db", "mlartifacts")
    children = {
        attack_name(cfg.name, question, seed) for question in ("q" * 200, "q" * 199, "x/1") for seed in (0, 10**30)
    }
    assert len(children) == 6 and all(RunLayout(str(root), child).run_name == child for child in children)


FEEDBACK_KEYS = st.text(alphabet=st.sampled_from("abcdefgKEYauthpwd_ѕＳ"), min_size=1, max_size=30)


@settings(max_examples=80, deadline=None)
@given(feedback=st.sampled_from(["opd", "sdpo", "sdpo_relax"]), key=FEEDBACK_KEYS)
@example(feedback="sdpo", key="success_reward_threshold")
def test_feedback_kwargs_the_class_does_not_take_are_refused_while_loading(tmp_path_factory, feedback, key):
    """They used to pass `sdpo validate`; the run then created its folder, stored them and failed in
    the teacher stage with a TypeError."""
    from sdpo_core.feedback import feedback_class, feedback_parameters

    path = write(
        tmp_path_factory.mktemp("feedback"),
        f"name: x\nloss:\n  type: sdpo\nteacher:\n  feedback: {feedback}\n  feedback_kwargs:\n    {key}: 1\n",
    )
    known = key in feedback_parameters(feedback_class(feedback))
    if known:
        return
    with pytest.raises(ConfigError, match=rf"{path}:6: teacher.feedback_kwargs: \[.*\] are not parameters of"):
        load_config(path, ["rollout.group_size=2"] if feedback != "opd" else [])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ("{success_threshold: high}", r"success_threshold='high': Input should be a valid number"),
        ("{solution_template: 'no placeholder'}", r"solution_template .*missing placeholders"),
        ("{demo_overflow: drop}", r"demo_overflow='drop'"),
        ("{max_demo_chars: 0}", r"max_demo_chars must be >= 1"),
    ],
)
def test_feedback_kwargs_are_typed_and_checked_by_the_class_while_loading(tmp_path, kwargs, message):
    path = write(tmp_path, f"teacher:\n  feedback_kwargs: {kwargs}\n")
    with pytest.raises(ConfigError, match=rf"{path}:2: teacher.feedback_kwargs: .*{message}"):
        load_config(path)


def test_a_feedback_class_that_does_not_resolve_is_refused_while_loading():
    with pytest.raises(ConfigError, match=r"override 1: teacher.feedback: unknown feedback policy 'sdpo2'"):
        load_config(None, ["teacher.feedback=sdpo2"])
    with pytest.raises(ConfigError, match=r"teacher.feedback: 'os:path' resolves to .* not a FeedbackPolicy"):
        load_config(None, ["teacher.feedback=os:path"])


@settings(max_examples=40, deadline=None)
@given(line=st.integers(min_value=4, max_value=40), bad=st.sampled_from(["memory=512", "nproc=1", "nproc=2.5"]))
def test_an_error_in_verifier_kwargs_names_the_override_that_set_it(tmp_path_factory, line, bad):
    """The mapping came from the file (line `line`) merged with the override: both are named; the
    error used to name the file's line alone."""
    path = write(
        tmp_path_factory.mktemp("place"),
        "name: x\n" + "\n" * (line - 4) + "verifier:\n  name: code\n  kwargs: {per_test_s: 2.0}\n",
    )
    with pytest.raises(ConfigError, match=rf"  {path}:{line}, override 2: verifier.kwargs: "):
        load_config(path, ["seed=1", f"verifier.kwargs.{bad}"])
    with pytest.raises(ConfigError, match=r"  override 1: verifier.kwargs: "):  # the whole mapping overridden
        load_config(path, [f"verifier.kwargs={{{bad.replace('=', ': ')}}}"])
