"""No spelling of a credential, and no storage option, reaches a file, a database or the output.

The refusals run the CLI for real with the flow replaced by a tripwire (tests/integration/
test_preflight.py); the end-to-end test runs a real `sdpo run` process on Prefect's ephemeral server
and then reads every byte it left behind: the run folder, the MLflow store and its artifacts, the
Prefect database and the checkpoint cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from tasks.config import apply_overrides
from tests.integration.runs import write_config
from tests.integration.test_preflight import DEMO, assert_nothing_written, files_containing, run_cli, workdir

__all__ = ["workdir"]  # the fixture, imported for the tests below

REPO = Path(__file__).resolve().parents[2]
SECRET = "SENTINEL-a7c3e90b"

SPELLED = {
    "camelCase": f"storage.storage_options.secretAccessKey={SECRET}",
    "hyphens": f"storage.storage_options.aws-secret-access-key={SECRET}",
    "list-nested": f"storage.storage_options.config_kwargs.proxies_config=[{{auth: [{SECRET}]}}]",
    "SSE-C customer key": f"storage.storage_options.s3_additional_kwargs={{SSECustomerKey: {SECRET}}}",
    "token in the endpoint's query": f"storage.storage_options.endpoint_url='https://s3.example.com/?X-Amz-Security-Token={SECRET}'",
    # accepted and stored before the config's fields became allow-lists
    "tracking.uri ?key=": f"tracking.uri=https://mlflow.example/?key={SECRET}",
    "tracking.uri ?auth=": f"tracking.uri=https://mlflow.example/?auth={SECRET}",
    "tracking.uri TOKEN@host": f"tracking.uri=http://{SECRET}@mlflow.example",
    "tracking.ui_url ?pwd=": f"tracking.ui_url=http://127.0.0.1:5000/?pwd={SECRET}",
    **{
        f"{section} {key}": f"{section}.{key}={SECRET}"
        for section in ("model.chat_template_kwargs", "teacher.feedback_kwargs")
        for key in ("KEY", "auth", "pwd", "AWS_SECRET_ACCESS", "secret_acces_key", "ѕecret", "ＳＥＣＲＥＴ")
    },
}


@pytest.mark.parametrize("command", ["run", "validate"])
@pytest.mark.parametrize("where", ["override", "yaml"])
@pytest.mark.parametrize("case", list(SPELLED))
def test_a_credential_spelled_any_way_is_refused_before_anything_is_written(workdir, command, where, case):
    args = [command, DEMO, "storage.root=runs", SPELLED[case]]
    if where == "yaml":
        config = workdir / "with_secret.yaml"
        tree = apply_overrides(yaml.safe_load(Path(DEMO).read_text()), args[2:])
        config.write_text(yaml.safe_dump(tree))
        args = [command, str(config)]
    result = run_cli(*args)
    assert result.exit_code == 2, result.output
    assert SECRET not in result.output and "profile" in result.output
    assert files_containing(workdir, SECRET) == ([workdir / "with_secret.yaml"] if where == "yaml" else [])
    assert_nothing_written(workdir, allowed={"with_secret.yaml"})


def test_storage_options_as_an_override_of_a_run_are_refused(workdir):
    """An override is a parameter of the run's flow run, which Prefect stores: options go in the file."""
    result = run_cli("run", DEMO, "storage.root=runs", "storage.storage_options.endpoint_url=http://minio:9000")
    assert result.exit_code == 2 and "config file" in result.output
    assert_nothing_written(workdir, allowed=set())
    assert run_cli("validate", DEMO, "storage.storage_options.endpoint_url=http://minio:9000").exit_code == 0


def test_a_run_stores_no_storage_option_and_no_credential(tmp_path):
    """Every allowed storage option that takes text holds a sentinel, and so do the environment's
    credentials; after a real `sdpo run`, no file under its working directory holds one."""
    mark = uuid.uuid4().hex[:12]
    sentinels = {
        "endpoint_url": f"http://sentinel-endpoint-{mark}.invalid:9000",
        "profile": f"sentinel-profile-{mark}",
        "region_name": f"sentinel-region-{mark}",
        "AWS_ACCESS_KEY_ID": f"SENTINELKEYID{mark.upper()}",
        "AWS_SECRET_ACCESS_KEY": f"sentinel-secret-{mark}",
        "AWS_SESSION_TOKEN": f"sentinel-session-{mark}",
    }
    options = {
        "endpoint_url": sentinels["endpoint_url"],
        "profile": sentinels["profile"],
        "anon": False,
        "use_ssl": True,
        "requester_pays": False,
        "client_kwargs": {"region_name": sentinels["region_name"]},
        "config_kwargs": {"connect_timeout": 5, "retries": {"max_attempts": 2, "mode": "standard"}},
    }
    # a local root: fsspec's local file system takes the s3 options and ignores them
    config = write_config(tmp_path, "creds", storage={"storage_options": options}, iterations=1)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_URL", "PREFECT_HOME", "AWS_"))}
    env.update({k: v for k, v in sentinels.items() if k.startswith("AWS_")})
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", str(config)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    prefect_db = tmp_path / ".sdpo" / "prefect" / "creds" / "prefect.db"
    records = {
        "run.json": tmp_path / "runs" / "creds" / "run.json",
        "MLflow store": tmp_path / "mlflow.db",
        "Prefect database": prefect_db,
    }
    for what, path in records.items():  # the search below reads where the records really are
        assert path.is_file() and b"creds" in path.read_bytes(), what
    assert str(config).encode() in prefect_db.read_bytes()  # the flow run's parameters are in it
    searched = [p for p in tmp_path.rglob("*") if p.is_file() and p != config]
    assert any("config.json" == p.name for p in searched)  # the config artifact logged to MLflow
    found = {
        name: [str(p.relative_to(tmp_path)) for p in searched if value.encode() in p.read_bytes()]
        for name, value in sentinels.items()
    }
    assert found == {name: [] for name in sentinels}
    for name, value in sentinels.items():
        assert value not in done.stdout + done.stderr, name
    assert json.loads(records["run.json"].read_text())["config"]["storage"].get("storage_options") is None
