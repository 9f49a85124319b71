"""An audit trail that a deliberate edit cannot pass, on real runs, on a local and an S3 store.

A run is killed in the train stage of its second iteration (iteration 1 committed; the rollout and
teacher stages of iteration 2 committed, the iteration not), then edited as a writer of the store
can: a metric of the committed teacher manifest changed with every digest that covers it recomputed
up to LATEST; the uncommitted teacher manifest changed with its `content_sha256` recomputed, or with
the digest removed and `manifest_version: 1`. The store's own chain accepts the first (the limit of
digests kept beside what they cover); the digests the flow recorded in the run's MLflow run refuse
each of them: `sdpo verify` names the first manifest that departs, and the resume refuses it. With
tracking off, the signing key does the same; with neither, `sdpo verify` says the run is unanchored.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from storage.hashing import sha256_bytes
from storage.manifest import content_digest
from tests.integration.runs import sdpo_here, write_config
from tests.integration.test_crash_resume import sdpo

REPO = Path(__file__).resolve().parents[2]
NAME = "audited"
KILL_AT = "stage.start:train@2"
KEY = "the-operator's-signing-key"


def killed_run(tmp: Path, env: dict[str, str], *, root: str | None = None, **sections: Any) -> Path:
    """A run killed in iteration 2's train stage; returns its config."""
    config = write_config(tmp, NAME, root, **sections)
    killed = sdpo(["run", str(config)], env, crash_at=KILL_AT)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-2000:] + killed.stderr[-3000:]
    return config


def _rewrite(layout: Any, path: str, change: Callable[[dict], None]) -> None:
    url = layout.url(path)
    data = json.loads(layout.store.read_bytes(url))
    change(data)
    if "content_sha256" in data:
        data["content_sha256"] = content_digest(data)
    layout.store.write_bytes(url, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode())


def cover(layout: Any, edited: str) -> None:
    """Recompute every digest that covers the edited manifest, up to LATEST: each manifest that names
    a changed one by digest is rewritten, until none is left."""
    changed = {edited: sha256_bytes(layout.store.read_bytes(layout.url(edited)))}
    manifests = [layout.relative(u) for u in layout.store.list_files(layout.run_url) if u.endswith("/_manifest.json")]
    while changed:
        following: dict[str, str] = {}
        for path in manifests:
            data = json.loads(layout.store.read_bytes(layout.url(path)))
            if not _repoint(data, changed):
                continue
            data["content_sha256"] = content_digest(data)
            payload = (json.dumps(data, indent=1, sort_keys=True) + "\n").encode()
            layout.store.write_bytes(layout.url(path), payload)
            following[path] = sha256_bytes(payload)
        changed = following
        latest = json.loads(layout.store.read_bytes(layout.latest))
        if latest["manifest"] in changed:
            layout.store.write_bytes(
                layout.latest, json.dumps({**latest, "sha256": changed[latest["manifest"]]}).encode()
            )


def _repoint(value: Any, changed: dict[str, str]) -> bool:
    found = False
    if isinstance(value, dict):
        if value.get("path") in changed and "sha256" in value and value["sha256"] != changed[value["path"]]:
            value["sha256"] = changed[value["path"]]
            found = True
        for item in value.values():
            found = _repoint(item, changed) or found
    elif isinstance(value, list):
        for item in value:
            found = _repoint(item, changed) or found
    return found


EDITS: dict[str, tuple[str, Callable[[Any], None]]] = {
    "committed, every covering digest recomputed": (
        "iter-1/teacher/_manifest.json",
        lambda layout: (
            _rewrite(layout, "iter-1/teacher/_manifest.json", lambda d: d["metrics"].update({"edited/metric": 1.0})),
            cover(layout, "iter-1/teacher/_manifest.json"),
        ),
    ),
    "uncommitted, its digest recomputed": (
        "iter-2/teacher/_manifest.json",
        lambda layout: _rewrite(
            layout, "iter-2/teacher/_manifest.json", lambda d: d["metrics"].update({"edited/metric": 1.0})
        ),
    ),
    "uncommitted, the digest removed and version 1": (
        "iter-2/teacher/_manifest.json",
        lambda layout: _rewrite(
            layout,
            "iter-2/teacher/_manifest.json",
            lambda d: (d.pop("content_sha256"), d.pop("signature", None), d.update({"manifest_version": 1})),
        ),
    ),
}


def verify(layout: Any, env: dict[str, str]) -> subprocess.CompletedProcess:
    return sdpo_here(["verify", NAME, "--root", layout.root_url], env)


def attempt(layout: Any, config: Path, env: dict[str, str], edit: str) -> None:
    """Apply `edit`, then: verify exits 1 naming the edited manifest first; the resume refuses it,
    naming it; the store is put back as it was."""
    path, apply = EDITS[edit]
    saved = {u: layout.store.read_bytes(u) for u in layout.store.list_files(layout.run_url) if u.endswith(".json")}
    saved[layout.latest] = layout.store.read_bytes(layout.latest)
    apply(layout)
    try:
        checked = verify(layout, env)
        assert checked.returncode == 1, checked.stdout + checked.stderr
        first = next(line for line in checked.stderr.splitlines() if "first manifest that departs" in line)
        assert layout.url(path) in first, checked.stderr
        resumed = sdpo(["run", str(config)], env)
        assert resumed.returncode != 0, resumed.stdout[-2000:]
        assert layout.url(path) in resumed.stdout + resumed.stderr, resumed.stderr[-4000:]
        assert "DamagedOutputError" in resumed.stderr or "CorruptManifestError" in resumed.stderr
    finally:
        for url, data in saved.items():
            layout.store.write_bytes(url, data)


def base_env(prefect_server: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SDPO_CRASH_AT", "SDPO_SIGNING_KEY")}
    return {**env, "PREFECT_API_URL": prefect_server, "PYTHONUNBUFFERED": "1", **extra}


def finish_and_verify(layout: Any, config: Path, env: dict[str, str], anchored: str) -> None:
    done = sdpo(["run", str(config)], env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    checked = verify(layout, env)
    assert checked.returncode == 0 and anchored in checked.stdout, checked.stdout + checked.stderr


def test_edits_of_a_local_run_are_named_by_verify_and_refused_by_the_resume(tmp_path, prefect_server):
    from storage.layout import RunLayout

    env = base_env(prefect_server)
    config = killed_run(tmp_path, env)
    layout = RunLayout(str(tmp_path / "runs"), NAME)
    for edit in EDITS:
        attempt(layout, config, env, edit)
    finish_and_verify(layout, config, env, "anchored:")


def test_edits_of_a_run_on_s3_are_named_by_verify_and_refused_by_the_resume(tmp_path, prefect_server, s3_server):
    from storage.layout import RunLayout

    options = s3_server.storage_options()
    root = f"s3://{s3_server.make_bucket()}/runs"
    env = base_env(
        prefect_server,
        AWS_ACCESS_KEY_ID=options["key"],
        AWS_SECRET_ACCESS_KEY=options["secret"],
        AWS_DEFAULT_REGION=options["client_kwargs"]["region_name"],
        AWS_ENDPOINT_URL=s3_server.endpoint_url,
    )
    config = killed_run(tmp_path, env, root=root, storage={"storage_options": {"endpoint_url": s3_server.endpoint_url}})
    layout = RunLayout(root, NAME, storage_options=options)
    for edit in EDITS:
        attempt(layout, config, env, edit)
    finish_and_verify(layout, config, env, "anchored:")


def test_with_tracking_off_the_signing_key_anchors_the_run(tmp_path, prefect_server):
    from storage.layout import RunLayout

    env = base_env(prefect_server, SDPO_SIGNING_KEY=KEY)
    config = killed_run(tmp_path, env, tracking={"enabled": False})
    layout = RunLayout(str(tmp_path / "runs"), NAME)
    for edit in EDITS:
        attempt(layout, config, env, edit)
    finish_and_verify(layout, config, env, "signed:")
    without_key = verify(layout, base_env(prefect_server))
    assert without_key.returncode == 0 and "unanchored:" in without_key.stdout, without_key.stdout


def test_verify_says_plainly_when_nothing_anchors_the_run(tmp_path, prefect_server):
    """Tracking off and no key: the digests in the store are all there is, and the committed edit
    whose every covering digest is recomputed passes; `sdpo verify` says what that proves."""
    from storage.layout import RunLayout

    env = base_env(prefect_server)
    config = write_config(tmp_path, NAME, tracking={"enabled": False}, iterations=1)
    assert sdpo(["run", str(config)], env).returncode == 0
    layout = RunLayout(str(tmp_path / "runs"), NAME)
    EDITS["committed, every covering digest recomputed"][1](layout)
    checked = verify(layout, env)
    assert checked.returncode == 0 and "unanchored: no tracking record of this run and no signing key" in checked.stdout
    assert "whoever can write the store can edit a manifest and recompute them" in checked.stdout
