"""`verify_run` on hand-written manifests (memory://): malformed fields are reported, never raised."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import fsspec
import pytest

from storage import RunLayout, create_or_open_run
from storage.manifest import content_digest
from storage.verify import verify_run


@pytest.fixture
def layout() -> Iterator[RunLayout]:
    url = f"memory://verify-{uuid.uuid4().hex}"
    layout = RunLayout(url, "r")
    create_or_open_run(layout, {"seed": 1})
    yield layout
    fsspec.filesystem("memory").rm(url, recursive=True)


@pytest.mark.parametrize("kind", [["stage"], {"stage": 1}, 7, None], ids=["list", "dict", "int", "null"])
def test_a_manifest_kind_that_is_no_name_is_reported(layout: RunLayout, kind: object) -> None:
    url = layout.stage_manifest(1, "rollout")
    data = {"kind": kind, "files": [], "parents": []}
    layout.store.write_bytes(url, json.dumps({**data, "content_sha256": content_digest(data)}).encode())
    report = verify_run(layout)
    assert report.problems == [(url, f"field 'kind' is {kind!r}, expected one of ['checkpoint', 'iteration', 'stage']")]
