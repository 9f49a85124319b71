"""Storage options: only those known not to be secrets are accepted (an allow-list), however a
credential is spelled, and none is ever written into a run's records (run.json, MLflow params,
config artifacts, flow-run parameters). Every attack is tried through the file, an override and
the typed config alone (without the name filter that runs first while loading)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.config import ConfigError, build_config, config_hash, flatten, load_config, to_dict

SECRET = "SENTINEL-5e81c0d2"

# storage.storage_options spellings of a credential that a list of names would miss
SPELLED = {
    "camelCase": {"secretAccessKey": SECRET},
    "camelCase id": {"accessKeyId": SECRET},
    "camelCase session": {"sessionToken": SECRET},
    "hyphens": {"aws-secret-access-key": SECRET},
    "hyphenated token": {"session-token": SECRET},
    "list-nested": {"config_kwargs": {"proxies_config": [{"proxy_ca_bundle": "x", "auth": [SECRET]}]}},
    "list of mappings": {"client_kwargs": [{"aws_secret_access_key": SECRET}]},
    "list value": {"endpoint_url": [SECRET]},
    "s3fs customer key (SSE-C)": {"s3_additional_kwargs": {"SSECustomerKey": SECRET}},
    "boto customer key": {"SSECustomerKey": SECRET},
    "snake customer key": {"sse_customer_key": SECRET},
    "session argument": {"session": {"aws_session_token": SECRET}},
    "username/password": {"username": "u", "password": SECRET},
    "token in the endpoint's query": {"endpoint_url": f"https://s3.example.com/?X-Amz-Security-Token={SECRET}"},
    "token in a bare query": {"endpoint_url": f"http://minio.internal:9000?token={SECRET}"},
    "signature in the query": {"endpoint_url": f"https://s3.example.com?X-Amz-Signature={SECRET}"},
    "token in the fragment": {"endpoint_url": f"https://s3.example.com#{SECRET}"},
    "token in the path": {"endpoint_url": f"https://s3.example.com/{SECRET}"},
    "user info": {"endpoint_url": f"https://{SECRET}@s3.example.com"},
    "region holding a secret": {"client_kwargs": {"region_name": f"eu-west-1?{SECRET}"}},
}


def options_tree(options: dict) -> dict:
    return {"name": "x", "storage": {"root": "s3://bucket/runs", "storage_options": options}}


def assert_refused_well(err: ConfigError) -> None:
    text = str(err)
    assert SECRET not in text
    assert "storage.storage_options" in text or "storage.root" in text
    assert "environment" in text and "profile" in text  # says where credentials go instead


@pytest.mark.parametrize("case", list(SPELLED))
def test_the_typed_config_alone_refuses_every_spelling(case):
    """The allow-list in the config classes holds without the name filter that runs while loading."""
    with pytest.raises(ConfigError) as err:
        build_config(options_tree(SPELLED[case]))
    assert_refused_well(err.value)


@pytest.mark.parametrize("case", list(SPELLED))
def test_every_spelling_is_refused_from_the_file_with_its_line(tmp_path, case):
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(options_tree(SPELLED[case]), indent=1))  # JSON is YAML, one key a line
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert_refused_well(err.value)
    assert f"{path}:" in str(err.value)


@pytest.mark.parametrize("case", list(SPELLED))
def test_every_spelling_is_refused_as_an_override(case):
    key, value = list(SPELLED[case].items())[-1]
    override = f"storage.storage_options.{key}={json.dumps(value)}"
    with pytest.raises(ConfigError) as err:
        load_config(None, ["storage.root=s3://bucket/runs", override])
    assert_refused_well(err.value)


@pytest.mark.parametrize(
    "root",
    [
        f"s3://bucket/runs?X-Amz-Security-Token={SECRET}",
        f"s3://bucket/runs#{SECRET}",
        f"s3://AKIAEXAMPLE:{SECRET}@bucket/runs",
        f"s3://{SECRET}@bucket/runs",
    ],
)
def test_a_root_url_carrying_a_credential_is_refused(root):
    for load in (
        lambda: build_config({"storage": {"root": root}}),
        lambda: load_config(None, [f"storage.root={root}"]),
    ):
        with pytest.raises(ConfigError) as err:
            load()
        assert_refused_well(err.value)


def test_credentials_spelled_differently_elsewhere_in_the_config_are_refused():
    """Free-form sections (feedback kwargs, chat-template kwargs) get the name filter, spelling-blind."""
    for override in (
        f"teacher.feedback_kwargs.apiKey={SECRET}",
        f"teacher.feedback_kwargs.x-api-key={SECRET}",
        f"model.chat_template_kwargs.hfToken={SECRET}",
        f"teacher.feedback_kwargs.headers=[{{Authorization: {SECRET}}}]",
        f"teacher.feedback_kwargs.url=https://api.example.com/v1?access_token={SECRET}",
    ):
        with pytest.raises(ConfigError) as err:
            load_config(None, [override])
        assert SECRET not in str(err.value) and "override 1" in str(err.value), override


ALLOWED = {
    "endpoint_url": "http://minio.internal:9000",
    "profile": "research-store",
    "anon": False,
    "use_ssl": True,
    "requester_pays": False,
    "client_kwargs": {"region_name": "eu-west-1"},
    "config_kwargs": {
        "connect_timeout": 5,
        "read_timeout": 30,
        "max_pool_connections": 16,
        "retries": {"max_attempts": 4, "mode": "standard"},
        "s3": {"addressing_style": "path"},
    },
}


def test_the_allowed_options_reach_fsspec_and_no_record():
    cfg = build_config(options_tree(ALLOWED))
    assert cfg.storage.storage_options.as_fsspec() == ALLOWED
    assert build_config(options_tree({})).storage.storage_options.as_fsspec() == {}
    frozen = to_dict(cfg)  # run.json, the config artifact
    assert "storage_options" not in frozen["storage"]
    assert not [k for k in flatten(frozen) if "storage_options" in k]  # the MLflow params
    assert config_hash(cfg) == config_hash(build_config(options_tree({})))  # where the store is, not what is computed


def test_an_unknown_option_error_names_it_and_lists_what_is_allowed():
    with pytest.raises(ConfigError, match=r"storage\.storage_options: 'default_block_size' is not an allowed"):
        build_config(options_tree({"default_block_size": 5}))
    with pytest.raises(ConfigError, match=r"storage\.storage_options\.config_kwargs: 'proxies' is not an allowed"):
        build_config(options_tree({"config_kwargs": {"proxies": {"http": "x"}}}))


def test_run_json_never_takes_storage_options(tmp_path):
    """The store refuses a config that carries storage options, whatever their names."""
    from storage.layout import RunLayout, create_or_open_run

    layout = RunLayout(str(tmp_path), "r")
    for options in ({"endpoint_url": "http://minio:9000"}, {"anything": SECRET}):
        with pytest.raises(ValueError, match=r"storage\.storage_options") as err:
            create_or_open_run(layout, {"storage": {"root": str(tmp_path), "storage_options": options}})
        assert SECRET not in str(err.value)
    assert not Path(tmp_path, "r", "run.json").exists()


def test_a_run_frozen_with_options_by_an_older_version_opens_unchanged(tmp_path):
    """run.json written before options left it: they are ignored when the run is opened or compared."""
    from storage.layout import RunLayout
    from tasks.runtime import open_run, start_run

    cfg = load_config(None, [f"storage.root={tmp_path}", "name=old"])
    layout = RunLayout(str(tmp_path), "old")
    start_run(cfg, layout)
    record = json.loads(layout.store.read_bytes(layout.run_json))
    record["config"]["storage"]["storage_options"] = {"endpoint_url": "http://a", "default_block_size": 5}
    layout.store.write_bytes(layout.run_json, json.dumps(record).encode())
    assert to_dict(open_run(str(tmp_path), "old").cfg) == to_dict(cfg)
    assert to_dict(start_run(cfg, layout).cfg) == to_dict(cfg)


def test_options_from_the_environment_pass_the_same_allow_list(monkeypatch):
    """A stage process takes its store options from SDPO_STORAGE_OPTIONS: credentials are refused there too."""
    from storage.urls import registered_options
    from tasks.launch import OPTIONS_ENV, register_stage_options

    monkeypatch.setenv(OPTIONS_ENV, json.dumps({"endpoint_url": "http://minio:9000", "secretAccessKey": SECRET}))
    with pytest.raises(ConfigError) as err:
        register_stage_options("s3://env-bucket/runs")
    assert SECRET not in str(err.value) and OPTIONS_ENV in str(err.value)
    assert registered_options("s3://env-bucket/runs") is None
    monkeypatch.setenv(OPTIONS_ENV, json.dumps({"endpoint_url": "http://minio:9000"}))
    register_stage_options("s3://env-bucket/runs")
    assert registered_options("s3://env-bucket/runs/r") == {"endpoint_url": "http://minio:9000"}


def test_no_flow_takes_storage_options_as_a_parameter():
    """Prefect stores a flow run's parameters: the flows take paths, names and overrides only."""
    import inspect

    from flows.evaluate import sdpo_eval
    from flows.iteration import sdpo_advance
    from flows.run import sdpo_run
    from flows.stage import sdpo_stage
    from flows.test_time import sdpo_test_time

    for flow in (sdpo_run, sdpo_advance, sdpo_eval, sdpo_stage, sdpo_test_time):
        assert not [p for p in inspect.signature(flow.fn).parameters if "option" in p], flow.name


def test_storage_options_cannot_be_overrides_of_a_flow_run():
    """Overrides are a flow run's parameters; storage options given as one would be stored with it."""
    from tasks.config import refuse_flow_overrides

    refuse_flow_overrides(["iterations=2", "storage.root=s3://b/r"])
    for override in ("storage.storage_options.endpoint_url=http://minio:9000", "storage.storage_options={anon: true}"):
        with pytest.raises(ConfigError, match=r"override 2 \(storage\.storage_options.*config file"):
            refuse_flow_overrides(["iterations=2", override])
