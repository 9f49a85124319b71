"""An audit trail that a deliberate edit cannot pass: manifests checked against the digests recorded
outside the store when they were committed, and against their signatures under a key.

Every edit here is one a writer of the store can make: valid JSON, the manifest's content digest
recomputed, every digest that covers it recomputed up to LATEST, or the digest removed and the
version set back to 1. Without an anchor the chain accepts each of them (the documented limit);
with the recorded digests or the signing key, each is refused, naming the first manifest edited."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage import RunLayout, anchor, create_or_open_run
from storage.anchored import adopt_recorded, committed_manifests
from storage.departures import departures
from storage.errors import CorruptManifestError, DamagedOutputError
from storage.hashing import sha256_bytes
from storage.manifest import commit_iteration, content_digest, read_manifest, read_stage_manifest
from storage.verify import verify_run
from tests.unit.test_storage_adopt import _iteration

KEY = "a-signing-key-held-by-the-operator"


@pytest.fixture
def layout(tmp_path: Path) -> Iterator[RunLayout]:
    root = f"memory://anchor-{uuid.uuid4().hex}"
    layout = RunLayout(root, "run")
    create_or_open_run(layout, {"lr": 1e-6})
    yield layout
    anchor.forget(layout.run_url)
    fsspec.filesystem("memory").rm(root, recursive=True)


def _commit(layout: RunLayout, n: int) -> None:
    stages = [read_stage_manifest(layout, n, s) for s in ("rollout", "teacher", "train")]
    metrics = {k: float(v) for m in stages for k, v in m.data["metrics"].items()}
    commit_iteration(layout, n, metrics=metrics)


def _rewrite(layout: RunLayout, path: str, change) -> str:
    """Apply `change` to the manifest at run-relative `path`, recompute its content digest (and keep
    it signed when it was: the editor has no key, so the signature stays the old one); its new sha256."""
    url = layout.url(path)
    data = json.loads(layout.store.read_bytes(url))
    change(data)
    if "content_sha256" in data:
        data["content_sha256"] = content_digest(data)
    payload = (json.dumps(data, indent=1, sort_keys=True) + "\n").encode()
    layout.store.write_bytes(url, payload)
    return sha256_bytes(payload)


def _edit_and_cover(layout: RunLayout, n: int, metric: float) -> None:
    """A metric of iteration n's committed teacher manifest changed, and every digest that covers it
    recomputed up to LATEST: the checkpoint trained on it, the train stage, the iteration manifest,
    each later iteration manifest, LATEST."""
    new: dict[str, str] = {}

    def repoint(refs):
        for ref in refs:
            if ref.get("path") in new:
                ref["sha256"] = new[ref["path"]]

    teacher, checkpoint = f"iter-{n}/teacher/_manifest.json", f"checkpoints/iter-{n}/policy/_manifest.json"
    new[teacher] = _rewrite(layout, teacher, lambda d: d["metrics"].update({"teacher/coverage": metric}))
    new[checkpoint] = _rewrite(layout, checkpoint, lambda d: repoint(d["trained_on"]))
    train = f"iter-{n}/train/_manifest.json"
    new[train] = _rewrite(layout, train, lambda d: repoint(d["parents"]))

    def restage(d):
        repoint([*d["stages"].values(), *d["checkpoints"].values()])
        d["metrics"]["teacher/coverage"] = metric

    head = _rewrite(layout, f"iter-{n}/_manifest.json", restage)
    pointer = json.loads(layout.store.read_bytes(layout.latest))
    for m in range(n + 1, pointer["iteration"] + 1):  # each later commit names the one before it
        head = _rewrite(layout, f"iter-{m}/_manifest.json", lambda d, h=head: d["previous"].update({"sha256": h}))
    layout.store.write_bytes(layout.latest, json.dumps({**pointer, "sha256": head}).encode())


def _run(layout: RunLayout, tmp_path: Path, *, iterations: int = 2) -> dict[str, str]:
    """Committed iterations 1..iterations, the rollout and teacher of the next; the digests a flow
    records of them."""
    for n in range(1, iterations + 1):
        _iteration(layout, n, tmp_path)
        _commit(layout, n)
    _iteration(layout, iterations + 1, tmp_path, through="teacher")
    return committed_manifests(layout)


def test_an_edit_of_a_committed_manifest_with_every_digest_recomputed_passes_the_chain_alone(layout, tmp_path):
    """The limit the anchors remove: the store's own chain checks out after the edit."""
    _run(layout, tmp_path)
    _edit_and_cover(layout, 1, 0.99)
    assert verify_run(layout).ok


@pytest.mark.parametrize("n", [1, 2])
def test_the_recorded_digests_name_the_edited_committed_manifest(layout, tmp_path, n):
    recorded = _run(layout, tmp_path)
    _edit_and_cover(layout, n, 0.99)
    first = departures(layout, recorded)
    assert first[0][0] == layout.url(f"iter-{n}/teacher/_manifest.json")
    assert "recorded when it was committed" in first[0][1]
    with pytest.raises(DamagedOutputError) as refused:  # the resume
        adopt_recorded(layout, recorded)
    assert refused.value.url == layout.url(f"iter-{n}/teacher/_manifest.json")


EDITS = {
    "a metric, digest recomputed": lambda d: d["metrics"].update({"teacher/coverage": 1.0}),
    "a file's size, digest recomputed": lambda d: d["files"][0].update({"bytes": d["files"][0]["bytes"] + 1}),
    "a parent's digest, recomputed": lambda d: d["parents"][0].update({"sha256": "0" * 64}),
    "the digest removed, version 1": lambda d: (d.pop("content_sha256"), d.update({"manifest_version": 1})),
}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edit=st.sampled_from(sorted(EDITS)), value=st.floats(-1e6, 1e6, allow_nan=False))
def test_an_edit_of_an_uncommitted_stage_is_refused_by_the_recorded_digest(tmp_path_factory, edit, value):
    layout = RunLayout(f"memory://anchor-{uuid.uuid4().hex}", "run")
    create_or_open_run(layout, {"lr": 1e-6})
    tmp = tmp_path_factory.mktemp("w")
    recorded = _run(layout, tmp, iterations=1)
    path = "iter-2/teacher/_manifest.json"

    def change(d):
        EDITS[edit](d)
        d.setdefault("metrics", {})["edited"] = value

    _rewrite(layout, path, change)
    with pytest.raises(DamagedOutputError) as refused:
        adopt_recorded(layout, recorded)
    assert refused.value.url == layout.url(path)
    assert [url for url, _ in departures(layout, recorded)] == [layout.url(path)]
    anchor.register(layout.run_url, recorded)  # and every read of this process refuses it
    with pytest.raises(CorruptManifestError, match="tracking record holds|no content_sha256"):
        read_manifest(layout, layout.url(path))
    anchor.forget(layout.run_url)


def test_an_unrecorded_stage_beyond_latest_is_computed_again_and_a_missing_one_forgotten(layout, tmp_path):
    recorded = _run(layout, tmp_path, iterations=1)
    teacher = "iter-2/teacher/_manifest.json"
    unrecorded = {p: d for p, d in recorded.items() if p != teacher}
    kept = adopt_recorded(layout, unrecorded)
    assert not layout.store.exists(layout.url(teacher))  # removed: the stage runs again
    assert layout.store.exists(layout.url("iter-2/rollout/_manifest.json")) and teacher not in kept
    layout.store.remove_tree(layout.stage_dir(2, "rollout"))
    assert "iter-2/rollout/_manifest.json" not in adopt_recorded(layout, recorded)


def test_a_commit_killed_before_its_record_is_recorded_only_as_the_commit_writes_it(layout, tmp_path):
    recorded = _run(layout, tmp_path)
    head = "iter-2/_manifest.json"
    before = {p: d for p, d in recorded.items() if p != head}
    assert adopt_recorded(layout, before)[head] == recorded[head]
    _rewrite(layout, head, lambda d: d["metrics"].update({"train/loss": 0.0}))
    pointer = json.loads(layout.store.read_bytes(layout.latest))
    new = sha256_bytes(layout.store.read_bytes(layout.url(head)))
    layout.store.write_bytes(layout.latest, json.dumps({**pointer, "sha256": new}).encode())
    with pytest.raises(DamagedOutputError, match="not what the commit writes from the recorded stages"):
        adopt_recorded(layout, before)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edit=st.sampled_from(sorted(EDITS)), where=st.sampled_from(["committed", "uncommitted"]))
def test_with_the_signing_key_every_edit_is_refused_where_it_is_read(tmp_path_factory, monkeypatch, edit, where):
    """No tracking record at all (tracking off): the signature alone refuses the edited manifest."""
    monkeypatch.setenv(anchor.SIGNING_KEY_ENV, KEY)
    layout = RunLayout(f"memory://anchor-{uuid.uuid4().hex}", "run")
    create_or_open_run(layout, {"lr": 1e-6})
    _run(layout, tmp_path_factory.mktemp("w"), iterations=1)
    path = "iter-1/teacher/_manifest.json" if where == "committed" else "iter-2/teacher/_manifest.json"
    assert "signature" in json.loads(layout.store.read_bytes(layout.url(path)))
    _rewrite(layout, path, EDITS[edit])
    with pytest.raises(CorruptManifestError, match="signature does not match|is not signed|no content_sha256"):
        read_manifest(layout, layout.url(path))
    report = verify_run(layout)
    assert layout.url(path) in [url for url, _ in report.problems]


def test_a_signed_manifest_cannot_move_or_be_read_without_its_key(layout, tmp_path, monkeypatch):
    monkeypatch.setenv(anchor.SIGNING_KEY_ENV, KEY)
    _iteration(layout, 1, tmp_path, through="teacher")
    _iteration(layout, 2, tmp_path, through="teacher")
    moved = layout.store.read_bytes(layout.stage_manifest(1, "teacher"))
    layout.store.write_bytes(layout.stage_manifest(2, "teacher"), moved)  # a valid manifest, another place
    with pytest.raises(CorruptManifestError, match="signature does not match"):
        read_manifest(layout, layout.stage_manifest(2, "teacher"))
    monkeypatch.setenv(anchor.SIGNING_KEY_ENV, "another key")
    with pytest.raises(CorruptManifestError, match="signature does not match"):
        read_manifest(layout, layout.stage_manifest(1, "teacher"))
    monkeypatch.delenv(anchor.SIGNING_KEY_ENV)
    assert read_manifest(layout, layout.stage_manifest(1, "teacher"))["kind"] == "stage"  # no key: not checked
