"""A run that cannot start fails before anything is written: bad data, a vocabulary-dependent limit,
a storage root that is a file, a credential in the config. The CLI is run for real; `sdpo_run` (the
Prefect flow) is replaced by a tripwire, so a check that let a bad run through fails the test
instead of starting a training run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "configs" / "demo.yaml")
SECRET = "SENTINEL-4d2a91c7"
runner = CliRunner()


def row(pid: str, text: str, **changes) -> dict:
    base = {
        "prompt_id": pid,
        "prompt_messages": [{"role": "user", "content": text}],
        "label": "3",
        "data_source": "arithmetic",
        "metadata": {},
    }
    return {**base, **changes}


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A fresh working directory; the flow is a tripwire."""
    import flows.run

    def tripwire(*args, **kwargs):
        raise AssertionError("the run started although its config or data is bad")

    monkeypatch.setattr(flows.run, "sdpo_run", tripwire)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PREFECT_HOME", raising=False)
    return tmp_path


def run_cli(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


def assert_nothing_written(workdir: Path, *, allowed: set[str]) -> None:
    assert {p.name for p in workdir.iterdir()} <= allowed  # no runs/, no .sdpo/ (Prefect, MLflow)


GOOD = [row("p1", "1+2"), row("p2", "2+2", label="4")]
BAD_DATA = {
    "a row without label": (
        [row("p1", "1+2"), {k: v for k, v in row("p2", "2+2").items() if k != "label"}],
        r"data\.jsonl:2: missing required field 'label'",
    ),
    "prompt_messages as a string": (
        [row("p1", "1+2", prompt_messages="What is 1+2?")],
        r"data\.jsonl:1: field 'prompt_messages' must be a non-empty list",
    ),
    "a label that is a number": ([row("p1", "1+2", label=3)], r"data\.jsonl:1: field 'label' must be text"),
    "a message without content": (
        [row("p1", "1+2", prompt_messages=[{"role": "user"}])],
        r"data\.jsonl:1: prompt_messages\[0\] must be an object with text",
    ),
    "a duplicate prompt_id": (
        [row("p1", "1+2"), row("p1", "2+2")],
        r"data\.jsonl:2: duplicate prompt_id 'p1' \(first at data\.jsonl:1\)",
    ),
    "a duplicate prompt": ([row("p1", "1+2"), row("p2", "1+2")], r"data\.jsonl:2: the same prompt as data\.jsonl:1"),
    "a row that is not an object": ([row("p1", "1+2"), ["p2"]], r"data\.jsonl:2: a row must be a JSON object"),
    "an empty file": ([], r"data\.jsonl: the data file holds no rows"),
}


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_prepared_data_fails_before_the_run_with_file_and_line(workdir, case):
    rows, message = BAD_DATA[case]
    write_rows(workdir / "data.jsonl", rows)
    result = run_cli("run", DEMO, "data.source=prepared", "data.path=data.jsonl", "storage.root=runs")
    assert result.exit_code == 2, result.output
    assert re.search(message, result.output), result.output
    assert_nothing_written(workdir, allowed={"data.jsonl"})


@pytest.mark.parametrize(
    ("eval_rows", "message"),
    [
        ([row("p1", "9+9")], r"eval\.jsonl:1: prompt_id 'p1' is also in the training data \(data\.jsonl:1\)"),
        ([row("e1", "2+2", label="4")], r"eval\.jsonl:1: the same prompt is in the training data \(data\.jsonl:2\)"),
    ],
)
def test_an_eval_file_overlapping_training_fails(workdir, eval_rows, message):
    write_rows(workdir / "data.jsonl", GOOD)
    write_rows(workdir / "eval.jsonl", eval_rows)
    result = run_cli(
        "run", DEMO, "data.source=prepared", "data.path=data.jsonl", "data.eval_path=eval.jsonl", "storage.root=runs"
    )
    assert result.exit_code == 2 and re.search(message, result.output), result.output
    assert_nothing_written(workdir, allowed={"data.jsonl", "eval.jsonl"})


def test_good_prepared_data_reaches_the_run(workdir):
    write_rows(workdir / "data.jsonl", GOOD)
    with pytest.raises(AssertionError, match="the run started"):
        run_cli("run", DEMO, "data.source=prepared", "data.path=data.jsonl", "storage.root=runs")


def test_top_k_above_the_vocabulary_fails_before_the_run(workdir):
    result = run_cli("run", DEMO, "loss.divergence=topk_tail", "rollout.top_k=500", "storage.root=runs")
    assert result.exit_code == 2
    assert "rollout.top_k=500 exceeds the tokenizer's vocabulary (117 ids)" in result.output
    assert_nothing_written(workdir, allowed=set())


def test_an_engine_on_cuda_without_a_cuda_device_fails_before_the_run(workdir, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = run_cli("run", DEMO, "rollout.device=cuda", "rollout.dtype=bfloat16", "storage.root=runs")
    assert result.exit_code == 2
    assert "rollout.device='cuda' but this machine has no CUDA device" in result.output
    assert_nothing_written(workdir, allowed=set())


def test_a_storage_root_that_is_a_file_is_named(workdir):
    (workdir / "runs").write_text("not a folder")
    result = run_cli("run", DEMO, "storage.root=runs")
    assert result.exit_code == 2 and "storage.root: 'runs' is a file, not a folder" in result.output


def test_the_bootstrap_vocabulary_size_is_the_tokenizers(tmp_path):
    from tasks.data.bootstrap_model import bootstrap_vocabulary_size, build_tokenizer

    assert bootstrap_vocabulary_size() == len(build_tokenizer(tmp_path))


def files_containing(root: Path, needle: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]


@pytest.mark.parametrize("command", ["run", "validate"])
@pytest.mark.parametrize("where", ["override", "yaml"])
def test_a_credential_reaches_no_output_no_file_and_no_prefect(workdir, command, where):
    args = [command, DEMO, "storage.root=runs", f"storage.storage_options.secret={SECRET}"]
    if where == "yaml":
        config = workdir / "with_secret.yaml"
        config.write_text(
            Path(DEMO).read_text() + f"\nstorage:\n  root: runs\n  storage_options:\n    token: {SECRET}\n"
        )
        args = [command, str(config)]
    result = run_cli(*args)
    assert result.exit_code == 2 and "looks like a credential" in result.output
    assert SECRET not in result.output
    assert files_containing(workdir, SECRET) == ([workdir / "with_secret.yaml"] if where == "yaml" else [])
    assert_nothing_written(workdir, allowed={"with_secret.yaml"})
