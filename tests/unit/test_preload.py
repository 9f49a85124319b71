"""What a process imports ahead of its stages, and the collector kept off it (tasks/preload.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tasks.config import build_config
from tasks.preload import HF_MODEL, MEGATRON_MODEL, stage_imports

REPO = Path(__file__).resolve().parents[2]


def imports_of(overrides: dict) -> list[str]:
    return stage_imports(build_config(overrides))


def test_the_default_run_imports_the_hf_model_code_then_megatron():
    assert imports_of({}) == list(dict.fromkeys(HF_MODEL + MEGATRON_MODEL))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        # training elsewhere: sampling and the HF teacher still load the HF model code here
        ({"launch": {"train": {"launcher": "subprocess"}}}, list(HF_MODEL)),
        # every model stage elsewhere: nothing heavy here
        (
            {"launch": {s: {"launcher": "subprocess"} for s in ("rollout", "teacher", "train", "eval")}},
            [],
        ),
        # sampling on SGLang, the Megatron teacher: Megatron only
        (
            {
                "rollout": {"engine": "sglang", "sglang": {"urls": ["http://127.0.0.1:30000"]}},
                "teacher": {"backend": "megatron"},
            },
            list(MEGATRON_MODEL),
        ),
    ],
)
def test_only_the_stages_kept_in_this_process_count(overrides, expected):
    assert imports_of(overrides) == expected


# A module that records whether the collector ran while it was imported, and makes cyclic objects.
PROBE_MODULE = """
import gc
COLLECTING = gc.isenabled()
class Node:
    def __init__(self):
        self.me = self
NODES = [Node() for _ in range(1000)]
"""

SCRIPT = """
import gc, json, sys
sys.path.insert(0, sys.argv[1])
from tasks.preload import freeze_for_exit, import_frozen
import_frozen(["probe_module"])
import probe_module
tracked = {id(o) for o in gc.get_objects()}
print(json.dumps({
    "collecting_during_import": probe_module.COLLECTING,
    "collecting_after": gc.isenabled(),
    "nodes_tracked": sum(id(n) in tracked for n in probe_module.NODES),
    "frozen": gc.get_freeze_count(),
}))
"""


def test_imports_run_with_the_collector_paused_and_end_frozen(tmp_path):
    """In a fresh process: the module's import sees the collector off, the collector is back on
    afterwards, and the module's objects sit in the permanent generation (no collection traverses
    them: `gc.get_objects` lists the collected generations only)."""
    (tmp_path / "probe_module.py").write_text(PROBE_MODULE)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    seen = json.loads(done.stdout)
    assert seen["collecting_during_import"] is False
    assert seen["collecting_after"] is True
    assert seen["nodes_tracked"] == 0
    assert seen["frozen"] >= 1000


@pytest.mark.parametrize(
    ("stage", "expected"),
    [("train", list(MEGATRON_MODEL)), ("rollout", list(HF_MODEL)), ("commit", [])],
)
def test_a_stage_process_imports_its_stages_libraries_frozen_before_the_stage(monkeypatch, stage, expected):
    """`sdpo stage NAME` (what the subprocess and torchrun launchers start) imports NAME's libraries
    through `import_frozen` first, then runs the stage, then leaves torch.distributed."""
    from types import SimpleNamespace

    from typer.testing import CliRunner

    import tasks.launch
    import tasks.preload
    import tasks.runtime
    from flows.cli import app

    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(tasks.runtime, "open_run", lambda root, run: SimpleNamespace(cfg=build_config({})))
    monkeypatch.setattr(tasks.preload, "import_frozen", lambda names: calls.append(("imports", names)))
    monkeypatch.setattr(tasks.launch, "run_stage", lambda *args: calls.append(("stage", args)))
    monkeypatch.setattr(tasks.launch, "leave_process_group", lambda: calls.append(("leave", None)))
    result = CliRunner().invoke(app, ["stage", stage, "--root", "/nowhere", "--run-name", "r", "--iteration", "1"])
    assert result.exit_code == 0, result.output
    assert calls == [("imports", expected), ("stage", (stage, "/nowhere", "r", 1)), ("leave", None)]
