"""A new Prefect home gets a copy of the migrated template database; the template holds no run,
an existing database is never replaced, and the ephemeral server runs flows on the copy."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap

import pytest

import flows.prefect_home as prefect_home


def _flow_runs(database) -> int:
    with sqlite3.connect(database) as db:
        return db.execute("select count(*) from flow_run").fetchone()[0]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("PREFECT_API_DATABASE_CONNECTION_URL", raising=False)
    return tmp_path / "cache"


def test_homes_are_seeded_from_one_template_and_flows_run_on_the_copy(cache, tmp_path, monkeypatch):
    first, second = tmp_path / "run-a", tmp_path / "run-b"
    assert prefect_home.seed_home(first)  # builds the template with Prefect's migrations, then copies
    template = prefect_home.template_dir() / prefect_home.DB_NAME
    assert template.is_file() and template.parent.parent == cache / "sdpo"
    assert not prefect_home.seed_home(first)  # a home with a database keeps it

    def no_build(*args, **kwargs):
        raise AssertionError("the template was built again")

    with monkeypatch.context() as patch:
        patch.setattr(prefect_home.subprocess, "run", no_build)
        assert prefect_home.seed_home(second)
    assert (second / "prefect.db").read_bytes() == template.read_bytes()

    script = textwrap.dedent(
        """
        from prefect import flow

        @flow
        def hello():
            return 42

        assert hello() == 42
        """
    )
    env = {
        **os.environ,
        "PREFECT_HOME": str(first),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    }
    env.pop("PREFECT_API_URL", None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _flow_runs(first / "prefect.db") == 1
    assert _flow_runs(template) == 0 and _flow_runs(second / "prefect.db") == 0


def test_an_existing_database_or_another_database_url_is_left_alone(cache, tmp_path, monkeypatch):
    def no_build(*args, **kwargs):
        raise AssertionError("nothing should be built")

    monkeypatch.setattr(prefect_home.subprocess, "run", no_build)
    home = tmp_path / "home"
    home.mkdir()
    (home / "prefect.db").write_bytes(b"a run's history")
    assert not prefect_home.seed_home(home)
    assert (home / "prefect.db").read_bytes() == b"a run's history"

    monkeypatch.setenv("PREFECT_API_DATABASE_CONNECTION_URL", "postgresql+asyncpg://db/prefect")
    assert not prefect_home.seed_home(tmp_path / "elsewhere")
    assert not (tmp_path / "elsewhere").exists()


def test_a_failed_build_names_the_template_folder_and_prefects_output(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(
        prefect_home.subprocess,
        "run",
        lambda *a, **k: subprocess.CompletedProcess(a, 1, stdout="", stderr="database is locked"),
    )
    with pytest.raises(RuntimeError, match=r"exited with 1 .*prefect-.*database is locked"):
        prefect_home.seed_home(tmp_path / "home")
    assert not (tmp_path / "home" / "prefect.db").exists()


def test_an_unwritable_cache_leaves_the_database_to_prefect(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))  # the template folder cannot be created under it
    monkeypatch.delenv("PREFECT_API_DATABASE_CONNECTION_URL", raising=False)
    assert not prefect_home.seed_home(tmp_path / "home")
    assert not (tmp_path / "home" / "prefect.db").exists()


LOCAL_MODE = """
import json, sys, time
from prefect import flow
from prefect.server.api.server import SubprocessASGIServer
from flows.cli.app import prefect_local_mode

seen = {}

def meanwhile():
    seen["meanwhile_ran"] = True
    if sys.argv[1] == "fail":
        return
    # the server's process is started by another thread while this runs
    deadline = time.monotonic() + 120
    while SubprocessASGIServer().server_process is None and time.monotonic() < deadline:
        time.sleep(0.05)
    seen["server_process_while_importing"] = SubprocessASGIServer().server_process is not None

if sys.argv[1] == "fail":
    def refuse(self, timeout=None):
        raise RuntimeError("the ephemeral server did not start")
    SubprocessASGIServer.start = refuse

@flow
def where():
    from prefect.context import get_run_context
    return get_run_context().client.api_url

try:
    with prefect_local_mode("overlap", meanwhile=meanwhile):
        seen["api_url"] = str(where())
except RuntimeError as err:
    seen["error"] = str(err)
seen["servers"] = [s.api_url for s in SubprocessASGIServer._instances.values()]
print(json.dumps(seen))
"""


@pytest.mark.parametrize("outcome", ["start", "fail"])
def test_the_ephemeral_server_starts_while_the_run_imports_and_its_failure_surfaces(cache, tmp_path, outcome):
    """`prefect_local_mode(meanwhile=...)` starts Prefect's ephemeral server on a thread while
    `meanwhile` (the run's imports) runs; the block's flow then runs on that same server, the one
    server of the process. A server that cannot start fails the block after `meanwhile` ran."""
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "home")}
    env.pop("PREFECT_API_URL", None)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(LOCAL_MODE), outcome],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    if outcome == "fail":
        assert seen["error"] == "the ephemeral server did not start"
        assert seen["meanwhile_ran"] and "api_url" not in seen
        return
    assert seen["server_process_while_importing"] is True
    assert len(seen["servers"]) == 1
    assert seen["api_url"].rstrip("/") == seen["servers"][0].rstrip("/")
