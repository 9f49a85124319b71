"""Bad and hostile run configs fail while loading, naming the file, line and field (never a secret)."""

from __future__ import annotations

from pathlib import Path

import pytest

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
