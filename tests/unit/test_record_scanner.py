"""Credentials are refused by allow-list in the config, and every record passes one scanner before it
is written: run.json and config_changes.jsonl, MLflow params, tags and artifacts, the parameters of
the flow runs Prefect stores and the Prefect artifacts. The value is never shown."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from storage.credentials import CredentialInRecordError, check_record, credential_name, url_problem
from tasks.config import ConfigError, load_config

SECRET = "SENTINEL-55c0ffee"

# -- what the scanner reads as a credential, however it is spelled ------------------------------
STEMS = ["secret", "password", "passwd", "token", "api_key", "access_key", "auth", "pwd", "key", "credential"]
STEMS += ["private_key", "session_token", "cookie", "signature", "passphrase", "bearer"]
CONFUSABLE = {"s": "ѕ", "e": "е", "o": "о", "a": "а", "c": "с", "p": "р", "i": "і", "x": "х"}


@st.composite
def spellings(draw: st.DrawFn) -> str:
    """A credential's name as someone may write it: any case, separators, camel case, words around
    it, letters of other scripts that look Latin, full-width letters."""
    words = draw(st.lists(st.sampled_from(["aws", "my", "hf", "x", "id", "value", "s3"]), max_size=2))
    words.insert(draw(st.integers(0, len(words))), draw(st.sampled_from(STEMS)))
    case = draw(st.sampled_from(["lower", "upper", "camel", "title"]))
    words = [
        {"lower": w, "upper": w.upper(), "title": w.title(), "camel": w.title() if i else w}[case]
        for i, w in enumerate(words)
    ]
    name = draw(st.sampled_from(["_", "-", ".", "" if case in ("camel", "title") else "_"])).join(words)
    swap = draw(st.sampled_from(["none", "confusable", "fullwidth"]))
    if swap == "confusable":
        name = "".join(CONFUSABLE.get(c, c) if draw(st.booleans()) else c for c in name)
    elif swap == "fullwidth":
        name = "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in name)
    return name


@settings(max_examples=400, deadline=None)
@given(name=spellings())
@example(name="KEY")
@example(name="AWS_SECRET_ACCESS")
@example(name="secret_acces_key")
@example(name="ѕecret")
@example(name="ＳＥＣＲＥＴ")
def test_a_credential_name_spelled_any_way_stops_the_record(name):
    assert credential_name(name)
    with pytest.raises(CredentialInRecordError) as err:
        check_record({"model": {"chat_template_kwargs": {name: SECRET}}}, record="run.json")
    assert SECRET not in str(err.value) and f"model.chat_template_kwargs.{name}" in str(err.value)
    check_record({"model": {"chat_template_kwargs": {name: 8192}}}, record="run.json")  # numbers are no credential


HOSTS = st.sampled_from(["mlflow.example", "127.0.0.1", "[::1]", "host-1.internal"])
NAMES = st.text(alphabet=st.sampled_from("abcdefKEYtoksigpwd_-"), min_size=1, max_size=12)


@st.composite
def urls_with_credentials(draw: st.DrawFn) -> str:
    scheme = draw(st.sampled_from(["http", "https", "postgresql", "s3", "sqlite"]))
    host = draw(HOSTS)
    port = draw(st.sampled_from(["", ":5000"]))
    where = draw(st.sampled_from(["user", "user:password", "query", "fragment query", "fragment"]))
    if where.startswith("user"):
        user = SECRET if where == "user" else f"admin:{SECRET}"
        return f"{scheme}://{user}@{host}{port}/path"
    name = draw(NAMES.filter(lambda n: n != "workflowType"))
    if where == "query":
        return f"{scheme}://{host}{port}/path?{name}={SECRET}"
    if where == "fragment query":
        return f"{scheme}://{host}{port}/#/runs?{name}={SECRET}"
    return f"{scheme}://{host}{port}/#{name}={SECRET}"


@settings(max_examples=300, deadline=None)
@given(url=urls_with_credentials(), prefix=st.sampled_from(["", "see ", "[link](", "tracking.uri="]))
@example(url=f"http://{SECRET}@host", prefix="")
@example(url=f"http://h/?key={SECRET}", prefix="")
@example(url=f"http://h/?auth={SECRET}", prefix="")
@example(url=f"http://h:5000/?pwd={SECRET}", prefix="")
def test_a_url_with_a_user_query_or_fragment_value_stops_the_record(url, prefix):
    assert url_problem(url) is not None
    with pytest.raises(CredentialInRecordError) as err:
        check_record({"tags": {"sdpo.view": prefix + url}}, record="MLflow tags")
    assert SECRET not in str(err.value) and "tags.sdpo.view" in str(err.value)


@pytest.mark.parametrize(
    "text",
    [
        "AKIAIOSFODNN7EXAMPLE",
        "-----BEGIN RSA PRIVATE KEY-----\nMIIE",
        "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.x",
        "ghp_" + "a1B2" * 9,
        "hf_" + "Ab3d" * 9,
        "sk-proj-" + "x9" * 12,
        "xoxb-1234567890-abcdef",
        "Authorization: Bearer 0123456789abcdefABCDEF",
    ],
)
def test_text_shaped_like_a_known_credential_stops_the_record(text):
    with pytest.raises(CredentialInRecordError, match=r"^summary.json: prompt holds text shaped like a credential"):
        check_record({"prompt": f"header {text} footer"}, record="summary.json")


def test_the_records_a_run_writes_pass():
    """Controls: every config the product ships, as run.json and the MLflow params hold it, the links
    the records carry and a hub model with a revision."""
    from tasks.config import flatten, to_dict

    for path in sorted(Path("configs").glob("*.yaml")):
        tree = to_dict(load_config(path))
        check_record(tree, record=str(path))
        check_record(flatten(tree), record=f"{path} params")
    check_record(
        {
            "link": "http://127.0.0.1:5000/#/experiments/1/runs/0af3?workflowType=machine_learning",
            "model.path": "hf://HuggingFaceTB/SmolLM2-135M-Instruct@main",
            "tracking.uri": "sqlite:////data/runs/mlflow.db",
            "sdpo.view": "sdpo view demo --root s3://bucket/runs",
            "prompt_template": "Basic arithmetic: what is {a} + {b}?",
            "train.pack_tokens": 8192,
        },
        record="controls",
    )


# -- the config's fields are allow-lists -------------------------------------------------------
URL_FIELDS = [
    "tracking.uri",
    "tracking.ui_url",
    "rollout.sglang.router_url",
    "model.path",
    "data.path",
    "data.eval_path",
    "storage.root",
]


@settings(max_examples=200, deadline=None)
@given(field=st.sampled_from([*URL_FIELDS, "rollout.sglang.urls"]), url=urls_with_credentials())
def test_every_url_field_refuses_a_user_query_or_fragment_without_showing_it(field, url):
    value = f"['{url}']" if field == "rollout.sglang.urls" else f"'{url}'"
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{field}={value}"])
    message = str(err.value)
    assert SECRET not in message and field in message and "MLFLOW_TRACKING_TOKEN" in message


@settings(max_examples=200, deadline=None)
@given(name=st.text(min_size=1, max_size=20).filter(lambda n: "." not in n and "=" not in n and n.strip() == n))
@example(name="KEY")
@example(name="ＳＥＣＲＥＴ")
@example(name="foo")
def test_chat_template_kwargs_take_only_documented_switches(name):
    """Any name but a documented switch is refused, whatever it is: a deny-list of spellings
    cannot win, the allow-list does not need to."""
    from tasks.config.urls import CHAT_TEMPLATE_SWITCHES

    if name in CHAT_TEMPLATE_SWITCHES:
        return
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"model.chat_template_kwargs.{json.dumps(name)}={SECRET}"])
    assert SECRET not in str(err.value) and "model.chat_template_kwargs" in str(err.value)


def test_the_documented_switches_pass_typed():
    cfg = load_config(None, ["model.chat_template_kwargs={enable_thinking: false, reasoning_effort: low}"])
    assert cfg.model.chat_template_kwargs == {"enable_thinking": False, "reasoning_effort": "low"}
    with pytest.raises(ConfigError, match=r"enable_thinking='no': Input should be a valid boolean"):
        load_config(None, ["model.chat_template_kwargs.enable_thinking='no'"])
    for ok in ("sqlite:////tmp/x.db", "http://mlflow:5000", "https://mlflow.example/prefix", "databricks"):
        assert load_config(None, [f"tracking.uri={ok}"]).tracking.uri == ok


# -- every place a config value is stored passes the scanner ------------------------------------
def _bypassing(cfg, section: str, **values):
    """`cfg` with values the config's checks would refuse (as if they had missed them)."""
    part = getattr(cfg, section).model_copy(update=values)
    return cfg.model_copy(update={section: part})


def test_run_json_and_config_changes_are_scanned(tmp_path):
    from storage.layout import RunLayout, create_or_open_run

    layout = RunLayout(str(tmp_path / "runs"), "scanned")
    bad = {"model": {"chat_template_kwargs": {"auth": SECRET}}}
    with pytest.raises(CredentialInRecordError, match="model.chat_template_kwargs.auth") as err:
        create_or_open_run(layout, bad)
    assert SECRET not in str(err.value) and not layout.store.exists(layout.run_json)
    create_or_open_run(layout, {"model": {}})
    with pytest.raises(CredentialInRecordError):
        create_or_open_run(layout, {"model": {"path": f"https://h/m?sig={SECRET}"}}, allow_config_change=True)
    assert not layout.store.exists(layout.config_changes)
    assert all(SECRET.encode() not in p.read_bytes() for p in (tmp_path / "runs").rglob("*") if p.is_file())


def _tracker(tmp_path: Path, cfg):
    from tasks.tracking.experiment import Tracker

    return Tracker(cfg, f"file://{tmp_path}/runs/{cfg.name}", local_root_dir=tmp_path)


def test_mlflow_params_tags_and_artifacts_are_scanned(tmp_path):
    from tasks.runtime import Run
    from tasks.tracking.summary import RunSummary

    cfg = load_config(None, ["name=scanned", "tracking.system_metrics=false"])
    with pytest.raises(CredentialInRecordError, match="MLflow params") as err:
        _tracker(tmp_path, _bypassing(cfg, "tracking", ui_url=f"http://ui/?token={SECRET}"))
    assert SECRET not in str(err.value)
    tracker = _tracker(tmp_path, cfg)
    with pytest.raises(CredentialInRecordError, match="MLflow tags"):
        tracker.set_tags({"sdpo.parent_run_url": f"s3://{SECRET}@bucket/runs/x"})
    note = tmp_path / "note.json"
    note.write_text(json.dumps({"tracking_uri": f"http://admin:{SECRET}@mlflow"}))
    with pytest.raises(CredentialInRecordError, match="MLflow artifact note.json"):
        tracker.log_artifact(note)
    from storage.layout import RunLayout

    run = Run(
        layout=RunLayout(str(tmp_path / "runs"), "scanned"), cfg=_bypassing(cfg, "data", path=f"s3://b/d?k={SECRET}")
    )
    summary = RunSummary(run_url=run.layout.run_url, tracking_uri=tracker.uri, loss_type="sdpo")
    with pytest.raises(CredentialInRecordError, match="MLflow artifact config.json"):
        summary.write_artifacts(run, tracker)
    assert all(SECRET.encode() not in p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p != note)


def test_the_parameters_of_a_flow_run_are_scanned():
    from tasks.config import refuse_flow_overrides

    with pytest.raises(ConfigError, match=r"the parameters of the flow run .*overrides.data.path") as err:
        refuse_flow_overrides(["seed=1", f"data.path=s3://bucket/data.jsonl?X-Amz-Signature={SECRET}"])
    assert SECRET not in str(err.value)
    with pytest.raises(ConfigError, match=r"config_path"):
        refuse_flow_overrides([], config_path=f"https://configs.example/run.yaml?token={SECRET}")
    refuse_flow_overrides(["seed=1", "data.path=s3://bucket/data.jsonl"], config_path="configs/demo.yaml")


def test_prefect_artifacts_are_scanned(monkeypatch):
    import prefect.artifacts

    from flows.artifacts import markdown_artifact

    created = []
    monkeypatch.setattr(prefect.artifacts, "create_markdown_artifact", lambda *a, **k: created.append((a, k)))
    with pytest.raises(CredentialInRecordError, match=r"Prefect artifact sdpo-x-summary: markdown holds a URL"):
        markdown_artifact(f"MLflow run: [link](http://ui:5000/?pwd={SECRET})", key="sdpo-x-summary")
    assert created == []
    markdown_artifact("MLflow run: http://ui:5000/#/experiments/1/runs/ab?workflowType=machine_learning", key="k")
    assert len(created) == 1
