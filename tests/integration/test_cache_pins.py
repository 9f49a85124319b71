"""The shared checkpoint cache under concurrent runs: eviction never removes a folder in use.

Runs started side by side share `storage.cache_dir`; with `storage.cache_max_gb` each one evicts the
least recently used checkpoints after its downloads. These tests run the readers as separate
processes, as the runs are, and check that a pinned folder outlives every other process's eviction.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from storage import RunLayout, create_or_open_run, upload_checkpoint
from storage.cache import download_checkpoint, evict_least_recently_used

ROOT = Path(__file__).resolve().parents[2]
SIZE = 64 * 1024  # bytes of one checkpoint's weights


def _checkpoints(tmp_path: Path, count: int) -> RunLayout:
    layout = RunLayout(str(tmp_path / "runs"), "run")
    create_or_open_run(layout, {"lr": 1e-6})
    rng = np.random.default_rng(0)
    for n in range(count):
        folder = tmp_path / "scratch" / f"ckpt-{n}"
        (folder / "hf").mkdir(parents=True)
        (folder / "hf" / "model.safetensors").write_bytes(rng.bytes(SIZE))
        (folder / "hf" / "config.json").write_text('{"model_type": "qwen3"}')
        upload_checkpoint(folder, layout, n, "policy", parent=None)
    return layout


def _reader(script: str, **names: object) -> subprocess.Popen[str]:
    """A Python process running `script` with `names` bound, talking over stdin / stdout."""
    preamble = "".join(f"{k} = {v!r}\n" for k, v in names.items())
    return subprocess.Popen(
        [sys.executable, "-c", preamble + textwrap.dedent(script)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


READ_ALL = """
    from pathlib import Path
    from storage.hashing import sha256_local_file
    from storage.checkpoints import resolve_checkpoint

    def read_all(layout, n, folder):
        for entry in resolve_checkpoint(layout, n).data["files"]:
            assert sha256_local_file(Path(folder) / entry["name"]) == entry["sha256"], entry["name"]
"""


def test_a_folder_pinned_by_another_process_survives_eviction(tmp_path: Path) -> None:
    layout = _checkpoints(tmp_path, 4)
    cache = tmp_path / "cache"
    child = _reader(
        READ_ALL
        + """
    import sys
    from storage import RunLayout
    from storage.cache import download_checkpoint, pinned_cache

    layout = RunLayout(root, "run")
    with pinned_cache():
        folder = download_checkpoint(layout, 0, cache_dir=cache)
        print("pinned", flush=True)
        sys.stdin.readline()  # the other process evicts meanwhile
        read_all(layout, 0, folder)
    print("read", flush=True)
    """,
        root=layout.root_url,
        cache=str(cache),
    )
    assert child.stdout is not None and child.stdin is not None
    assert child.stdout.readline().strip() == "pinned", child.stderr.read() if child.stderr else ""
    pinned = cache / download_checkpoint(layout, 0, cache_dir=cache).name
    one = sum(p.stat().st_size for p in pinned.rglob("*") if p.is_file())
    for n in (1, 2, 3):  # the least recently used is the pinned one, every time
        download_checkpoint(layout, n, cache_dir=cache, max_cache_bytes=one)
        assert pinned.is_dir(), f"the download of checkpoint {n} evicted a folder another process holds"
    out, err = child.communicate("go\n", timeout=60)
    assert child.returncode == 0 and out.strip() == "read", err

    removed = evict_least_recently_used(cache, max_bytes=one)  # the reader is gone: now it goes
    assert pinned in removed and not pinned.exists()
    assert not (cache / "pins" / pinned.name).exists()


def test_a_stage_holds_its_checkpoints_until_it_returns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`run_stage` is where every stage body runs (in the flow's process, a fresh process or a
    torchrun rank), so pins taken in a body last for the whole stage, not just the download call."""
    from tasks import launch

    layout = _checkpoints(tmp_path, 1)
    cache = tmp_path / "cache"
    seen: list[Path] = []

    def body(root: str, run: str, iteration: int) -> None:
        folder = download_checkpoint(RunLayout(root, run), 0, cache_dir=cache)
        assert evict_least_recently_used(cache, max_bytes=0) == []  # pinned while the stage runs
        seen.append(folder)

    monkeypatch.setitem(launch.STAGE_BODIES, "eval", body)
    launch.run_stage("eval", layout.root_url, "run", 1)
    assert seen and seen[0].is_dir()
    assert evict_least_recently_used(cache, max_bytes=0) == seen  # released when the stage returned


def test_runs_sharing_a_small_cache_read_every_checkpoint_whole(tmp_path: Path) -> None:
    """Three processes cycle through six checkpoints through one cache that holds two: each reads
    every file of each folder it is handed while the others download and evict around it."""
    layout = _checkpoints(tmp_path, 6)
    cache = tmp_path / "cache"
    script = (
        READ_ALL
        + """
    import random
    from storage import RunLayout
    from storage.cache import download_checkpoint, pinned_cache

    layout = RunLayout(root, "run")
    rng = random.Random(seed)
    for _ in range(20):
        n = rng.randrange(6)
        with pinned_cache():
            folder = download_checkpoint(layout, n, cache_dir=cache, max_cache_bytes=bound)
            read_all(layout, n, folder)
    print("done", flush=True)
    """
    )
    bound = 2 * (SIZE + len('{"model_type": "qwen3"}'))
    readers = [_reader(script, root=layout.root_url, cache=str(cache), seed=s, bound=bound) for s in range(3)]
    for reader in readers:
        out, err = reader.communicate(timeout=120)
        assert reader.returncode == 0 and out.strip() == "done", err[-3000:]
    evict_least_recently_used(cache, max_bytes=bound)
    cached = [p for p in cache.iterdir() if len(p.name) == 64]
    assert len(cached) <= 2
    assert sorted(p.name for p in (cache / "pins").iterdir()) == sorted(p.name for p in cached)
