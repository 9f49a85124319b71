"""`sdpo verify`, `status` and `lineage` on a real run: a flipped byte in any committed file is caught."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.integration.runs import write_config

runner = CliRunner()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory, prefect_server: str) -> Path:
    """A committed 1-iteration run (EMA teacher, so every checkpoint kind exists); returns its root."""
    from flows.run import sdpo_run

    tmp = tmp_path_factory.mktemp("verify")
    sdpo_run(str(write_config(tmp, "audited")), ["iterations=1"])
    return tmp / "runs"


# one file of each kind a run commits, relative to the run folder
KINDS = {
    "rollout shard": "iter-1/rollout/part-00000.parquet",
    "teacher shard": "iter-1/teacher/part-00000.parquet",
    "eval metrics": "iter-1/eval/metrics.json",
    "stage manifest": "iter-1/teacher/_manifest.json",
    "iteration manifest": "iter-1/_manifest.json",
    "policy weights": "checkpoints/iter-1/policy/files/model.safetensors",
    "teacher weights": "checkpoints/iter-1/teacher/files/model.safetensors",
    "megatron state": "checkpoints/iter-1/megatron/files/trainer_state.pt",
    "checkpoint manifest": "checkpoints/iter-1/policy/_manifest.json",
    "base model manifest": "checkpoints/iter-0/policy/_manifest.json",
    "LATEST": "LATEST",
    "run.json": "run.json",
}
# for these small JSON files, the byte flipped is the first of a digest (their timestamps are not guarded)
ANCHORS = {"LATEST": b'"sha256": "', "run.json": b'"config_hash": "'}


def verify(root: Path) -> tuple[int, str]:
    from flows.cli import app

    result = runner.invoke(app, ["verify", "audited", "--root", str(root)])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def test_a_clean_run_verifies(finished_run: Path) -> None:
    code, output = verify(finished_run)
    assert code == 0, output
    assert "OK: everything committed matches its manifests" in output


@pytest.mark.parametrize("kind", list(KINDS), ids=list(KINDS))
def test_a_flipped_byte_is_caught(finished_run: Path, kind: str) -> None:
    path = finished_run / "audited" / KINDS[kind]
    original = path.read_bytes()
    if kind in ANCHORS:
        index = original.index(ANCHORS[kind]) + len(ANCHORS[kind])
    else:  # a letter or digit past the middle: inside the data, or inside a JSON value
        index = next(i for i in range(len(original) // 2, len(original)) if chr(original[i]).isalnum())
    damaged = bytearray(original)
    damaged[index] = ord("0") if chr(original[index]) != "0" else ord("1")
    path.write_bytes(bytes(damaged))
    try:
        code, output = verify(finished_run)
    finally:
        path.write_bytes(original)
    assert code == 1, output
    assert "problem(s)" in output
    assert verify(finished_run)[0] == 0


def test_status_checks_latest_and_knows_the_target(finished_run: Path) -> None:
    from flows.cli import app

    ok = runner.invoke(app, ["status", "audited", "--root", str(finished_run)])
    assert ok.exit_code == 0, ok.output
    assert "LATEST = 1 of 1 iterations (digest verified)" in ok.output and "complete" in ok.output
    unknown = runner.invoke(app, ["status", "nonexistent", "--root", str(finished_run)])
    assert unknown.exit_code == 2 and "no run 'nonexistent'" in unknown.output

    latest = finished_run / "audited" / "LATEST"
    original = latest.read_text()
    latest.write_text(original.replace('"sha256": "', '"sha256": "0'))
    try:
        bad = runner.invoke(app, ["status", "audited", "--root", str(finished_run)])
    finally:
        latest.write_text(original)
    assert bad.exit_code == 2 and "sha256 mismatch" in bad.output


def test_lineage_checks_the_training_data_it_names(finished_run: Path) -> None:
    from storage.checkpoints import lineage
    from storage.layout import RunLayout

    layout = RunLayout(str(finished_run), "audited")
    records = lineage(layout)
    assert [(r.iteration, r.kind, r.committed) for r in records] == [
        (0, "policy", True),
        (1, "policy", True),
        (1, "teacher", True),
        (1, "megatron", True),
    ]
    assert all(r.trained_on_ok for r in records if r.iteration == 1)
    manifest = finished_run / "audited" / "iter-1" / "teacher" / "_manifest.json"
    original = manifest.read_bytes()
    manifest.write_bytes(original.replace(b'"rows": ', b'"rows":  ', 1))  # same content, other digest
    try:
        assert [r.trained_on_ok for r in lineage(layout) if r.iteration == 1] == [False, False, False]
    finally:
        manifest.write_bytes(original)


@pytest.mark.parametrize("kind", ["policy weights", "teacher weights"])
def test_the_train_stage_shares_its_checkpoints_with_the_cache_as_hard_links(finished_run: Path, kind: str) -> None:
    """`storage.link_uploads` (default): the weights the train stage stored are the files it adopted
    into the cache, one copy on disk, and the run still verifies (above)."""
    stored = (finished_run / "audited" / KINDS[kind]).stat()
    cached = [p for p in (finished_run.parent / "cache").rglob("model.safetensors") if p.stat().st_ino == stored.st_ino]
    assert stored.st_nlink == 2 and len(cached) == 1, (stored.st_nlink, cached)
