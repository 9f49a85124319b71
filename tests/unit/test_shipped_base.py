"""The demo's base model ships with the product (tasks/data/shipped_base.py): for exactly the
demo's settings, checked file by file, and refused when a file was damaged."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.config import load_config
from tasks.data.shipped_base import SHIPPED, copy_shipped, shipped_folder
from tasks.prepare_base import bootstrap_cache_dir
from tasks.runtime import Run

REPO = Path(__file__).resolve().parents[2]


def _key(*overrides: str) -> str:
    cfg = load_config(str(REPO / "configs/demo.yaml"), list(overrides))
    return bootstrap_cache_dir(Run(layout=None, cfg=cfg)).name  # type: ignore[arg-type]


def test_the_demo_config_has_its_base_model_shipped_and_nothing_else_does():
    """A change to the demo's settings (or to the key) that is not shipped again fails here; the
    module doc names the command that ships it."""
    assert shipped_folder(_key()) is not None, "run `.venv/bin/python -m tasks.prepare_base configs/demo.yaml`"
    assert shipped_folder(_key("seed=1")) is None
    assert shipped_folder(_key("model.bootstrap.warmup_steps=401")) is None
    assert [p.name for p in SHIPPED.iterdir()] == [_key()]


def test_a_damaged_shipped_file_is_refused_naming_it(tmp_path):
    source = tmp_path / "shipped"
    source.mkdir()
    for path in shipped_folder(_key()).iterdir():
        (source / path.name).write_bytes(path.read_bytes())
    good = tmp_path / "good"
    good.mkdir()
    copy_shipped(source, good)
    assert (good / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()
    weights = bytearray((source / "model.safetensors").read_bytes())
    weights[-1] ^= 1
    (source / "model.safetensors").write_bytes(bytes(weights))
    bad = tmp_path / "bad"
    bad.mkdir()
    with pytest.raises(RuntimeError, match="model.safetensors does not have the sha256"):
        copy_shipped(source, bad)
