"""`model.path` as a hub id or an `hf://` URL, offline, from a hub cache laid out as the hub client
lays it out (`models--ORG--NAME/{blobs,refs,snapshots/<commit>}`, files linked to their blobs),
which `huggingface_hub.scan_cache_dir` must recognise. Nothing here reaches the hub: every test runs
with the client offline (HF_HUB_OFFLINE) and its cache in the test's folder."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.integration.runs import write_config

REPO_ID = "tiny-org/tiny-policy"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TAGGED = "89abcdef0123456789abcdef0123456789abcdef"
PROJECT = Path(__file__).resolve().parents[2]


def _tiny_model(folder: Path) -> Path:
    from tasks.data.bootstrap_model import build_model, build_tokenizer

    tokenizer = build_tokenizer(folder)
    model = build_model(tokenizer, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, max_positions=128, seed=5)
    model.save_pretrained(folder)
    return folder


def _blob_name(data: bytes, *, lfs: bool) -> str:
    """The hub cache names a blob by its etag: the sha256 for an LFS file, else the git blob sha1."""
    if lfs:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _add_snapshot(cache: Path, repo_id: str, commit: str, files: dict[str, bytes], *, ref: str) -> Path:
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for name, data in files.items():
        blob = repo / "blobs" / _blob_name(data, lfs=name.endswith((".safetensors", ".pth")))
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def model_files(tmp_path_factory) -> dict[str, bytes]:
    """A tiny policy's files, plus what a hub repository holds beside them and a run must not take."""
    folder = _tiny_model(tmp_path_factory.mktemp("tiny-policy"))
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    files["README.md"] = b"# tiny policy\n"
    files["original/consolidated.pth"] = b"\0" * 64
    return files


@pytest.fixture
def hub_home(tmp_path, model_files, monkeypatch) -> Path:
    """HF_HOME with a hub cache holding REPO_ID at COMMIT (main) and at TAGGED (tag v1, with a copy of
    the policy in folder `sub`); the hub client
    offline and pointed at it, in this process and in the processes it starts."""
    from huggingface_hub import constants

    home = tmp_path / "hf-home"
    cache = home / "hub"
    _add_snapshot(cache, REPO_ID, COMMIT, model_files, ref="main")
    tagged = {**model_files, "generation_config.json": b'{"do_sample": false}'}
    tagged.update({f"sub/{name}": data for name, data in model_files.items() if "/" not in name})
    _add_snapshot(cache, REPO_ID, TAGGED, tagged, ref="v1")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return home


def test_the_test_cache_is_one_the_hub_client_recognises(hub_home):
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(hub_home / "hub")
    assert not info.warnings
    (repo,) = info.repos
    assert (repo.repo_id, repo.repo_type) == (REPO_ID, "model")
    revisions = {r.commit_hash: r for r in repo.revisions}
    assert set(revisions) == {COMMIT, TAGGED}
    assert revisions[COMMIT].refs == frozenset({"main"}) and revisions[TAGGED].refs == frozenset({"v1"})
    assert "model.safetensors" in {f.file_name for f in revisions[COMMIT].files}


@pytest.mark.parametrize(
    "path, commit",
    [
        (REPO_ID, COMMIT),
        (f"{REPO_ID}@v1", TAGGED),
        (f"{REPO_ID}@{TAGGED}", TAGGED),
        (f"hf://{REPO_ID}", COMMIT),
        (f"hf://{REPO_ID}@v1", TAGGED),
        (f"hf://{REPO_ID}@v1/sub", TAGGED),
    ],
)
def test_a_hub_id_resolves_offline_to_the_cached_commit(hub_home, tmp_path, path, commit):
    from tasks.hub import hub_model, policy_folder

    folder, info = policy_folder(hub_model(path), str(tmp_path / "cache"))
    assert info["hub"]["commit"] == commit and info["hub"]["repo_id"] == REPO_ID
    assert info["source"] == f"hf://{REPO_ID}@{commit}" + ("/sub" if path.endswith("/sub") else "")
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not names & {"README.md", "original", "sub"}  # only what a policy folder needs
    weights = hub_home / "hub" / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / commit / "model.safetensors"
    assert (folder / "model.safetensors").read_bytes() == weights.read_bytes()


def test_a_local_folder_wins_over_a_hub_id_and_urls_are_not_hub_ids(tmp_path, monkeypatch):
    from tasks.hub import hub_model

    monkeypatch.chdir(tmp_path)
    assert hub_model("some-org/some-model") is not None
    (tmp_path / "some-org" / "some-model").mkdir(parents=True)
    assert hub_model("some-org/some-model") is None
    assert hub_model("s3://bucket/models/x") is None and hub_model("/models/x") is None
    assert hub_model("models") is None


def test_a_hub_url_that_names_no_model_repository_fails_when_the_config_loads():
    from tasks.config import load_config

    with pytest.raises(Exception, match=r"model\.path='hf://datasets/org/data' names a dataset repository"):
        load_config(None, ["model.path=hf://datasets/org/data"])
    with pytest.raises(Exception, match=r"model\.path='hf://just-a-name' is not a hub model"):
        load_config(None, ["model.path=hf://just-a-name"])


def test_a_model_missing_from_the_offline_cache_is_named_before_the_run(hub_home, tmp_path, monkeypatch):
    import flows.run
    from flows.cli import app

    def tripwire(*args, **kwargs):
        raise AssertionError("the run started although its model cannot be had")

    monkeypatch.setattr(flows.run, "sdpo_run", tripwire)
    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path, "missing", model={"path": "other-org/absent@v2"})
    result = CliRunner().invoke(app, ["run", str(config)], catch_exceptions=False)
    assert result.exit_code != 0
    text = " ".join(result.output.split())
    assert "model.path='hf://other-org/absent@v2'" in text
    assert "hf download other-org/absent --revision v2" in text and "unset HF_HUB_OFFLINE" in text
    assert not (tmp_path / "runs").exists()


def test_sdpo_run_trains_a_model_given_by_hub_id_from_the_offline_cache(hub_home, tmp_path, prefect_server):
    from storage.checkpoints import read_checkpoint_manifest
    from storage.layout import RunLayout
    from storage.manifest import read_latest

    config = write_config(tmp_path, "from-hub", iterations=1, model={"path": REPO_ID})
    environment = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    environment.update(
        HF_HOME=str(hub_home),
        HF_HUB_OFFLINE="1",
        PREFECT_API_URL=prefect_server,
        PYTHONPATH=str(PROJECT),
        OMP_NUM_THREADS="1",
    )
    done = _cli(["run", str(config)], tmp_path, environment, timeout=540)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    layout = RunLayout(str(tmp_path / "runs"), "from-hub")
    assert read_latest(layout) == 1
    base = read_checkpoint_manifest(layout, 0, "policy").data
    assert base["metadata"]["hub"] == {"repo_id": REPO_ID, "revision": "main", "commit": COMMIT}
    assert base["parent"] == {"external": f"hf://{REPO_ID}@{COMMIT}"}
    names = {f["name"] for f in base["files"]}
    assert "model.safetensors" in names and "README.md" not in names
    weights = hub_home / "hub" / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / COMMIT / "model.safetensors"
    stored = next(f["sha256"] for f in base["files"] if f["name"] == "model.safetensors")
    assert stored == hashlib.sha256(weights.read_bytes()).hexdigest()


@pytest.fixture
def fake_hub():
    """An HTTP server answering the hub's model-info requests (`/api/models/ORG/NAME`) as the hub
    does: the repository KNOWN exists, any other is not found (404, `X-Error-Code: RepoNotFound`).
    Yields its address (HF_ENDPOINT)."""
    import http.server
    import json
    import threading

    class Hub(http.server.BaseHTTPRequestHandler):
        def log_message(self, format, *args):  # quiet
            pass

        def do_GET(self):
            found = self.path.split("?")[0].startswith(f"/api/models/{KNOWN}")
            body = json.dumps({"id": KNOWN, "sha": COMMIT} if found else {"error": "Repository not found"}).encode()
            self.send_response(200 if found else 404)
            if not found:
                self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


KNOWN = "tiny-org/on-the-hub"


def _validate(tmp_path: Path, model: str, endpoint: str) -> subprocess.CompletedProcess:
    """`sdpo validate` of a config whose model is `model`, the hub client online (no HF_HUB_OFFLINE)
    with an empty cache and HF_ENDPOINT = `endpoint`."""
    config = write_config(tmp_path, "on-hub", model={"path": model})
    environment = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != "TRANSFORMERS_OFFLINE"}
    environment.update(HF_HOME=str(tmp_path / "hf-home"), HF_ENDPOINT=endpoint, PYTHONPATH=str(PROJECT))
    return _cli(["validate", str(config)], tmp_path, environment, timeout=300)


def _cli(args: list[str], cwd: Path, environment: dict[str, str], *, timeout: float) -> subprocess.CompletedProcess:
    """`sdpo ARGS` as a process in `cwd` with `environment`, its output captured."""
    command = [sys.executable, "-m", "flows.cli", *args]
    return subprocess.run(command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=timeout)


def test_validate_names_a_hub_model_it_could_not_check_in_one_warning(tmp_path):
    """Online but the hub unreachable (nothing listens at HF_ENDPOINT): the config passes, with one
    warning line naming the model as unchecked and what was tried."""
    from tests.integration.conftest import _free_port

    endpoint = f"http://127.0.0.1:{_free_port()}"
    done = _validate(tmp_path, "nobody-org/no-such-model", endpoint)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    warnings = [line for line in done.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1, done.stderr
    assert "model.path='hf://nobody-org/no-such-model' is unchecked" in warnings[0]
    assert f"asked {endpoint}/api/models/nobody-org/no-such-model" in warnings[0]
    assert "name: on-hub" in done.stdout


def test_validate_fails_on_a_hub_model_the_hub_does_not_know(tmp_path, fake_hub):
    done = _validate(tmp_path, "nobody-org/no-such-model@v2", fake_hub)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    text = " ".join(done.stderr.split())
    assert "model.path='hf://nobody-org/no-such-model@v2': the hub has no such model or revision" in text
    assert f"asked {fake_hub}/api/models/nobody-org/no-such-model/revision/v2" in text
    assert "Traceback" not in done.stderr


def test_validate_passes_a_hub_model_the_hub_knows_without_a_warning(tmp_path, fake_hub):
    done = _validate(tmp_path, KNOWN, fake_hub)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "WARNING" not in done.stderr, done.stderr
