"""A checkpoint folder into a local (file://) store: copied, or handed over as hard links.

The train stage stores its policy, EMA teacher and full state by `upload_checkpoint` from a scratch
folder on the cache's file system. Copied, each file is read once and written once, and hashed on
the way. Handed over (`storage.link_uploads`), the store takes a hard link, so the file is only
read to be hashed. This writes one file of `--gb` GB of random bytes, then uploads it both ways,
alternating, and prints each upload's seconds, the medians and their ratio. Each stored copy is
removed before the next upload.

    .venv/bin/python -m benchmarks.checkpoint_upload [--gb 2.4] [--repeats 3] [--dir PATH]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from storage import RunLayout, create_or_open_run, upload_checkpoint
from storage.checkpoints import discard_checkpoint

CHUNK = 64 * 2**20


def write_file(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        left = size
        while left:
            block = os.urandom(min(CHUNK, left))
            f.write(block)
            left -= len(block)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.4, help="size of the weights file (0.6B in float32: 2.4)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the scratch folder and the store go (one file system)")
    args = parser.parse_args()
    logging.getLogger("storage").setLevel(logging.ERROR)  # each removal is logged as a discarded attempt
    base = Path(args.dir or tempfile.mkdtemp(prefix="upload-bench-"))
    try:
        run(base, gb=args.gb, repeats=args.repeats)
    finally:
        for made in [base] if args.dir is None else [base / "scratch", base / "runs"]:
            shutil.rmtree(made, ignore_errors=True)


def run(base: Path, *, gb: float, repeats: int) -> None:
    folder = base / "scratch" / "teacher"
    write_file(folder / "model.safetensors", int(gb * 2**30))
    (folder / "config.json").write_text('{"model_type": "qwen3"}')
    layout = RunLayout(str(base / "runs"), "bench")
    create_or_open_run(layout, {"bench": "checkpoint_upload"})
    seconds: dict[str, list[float]] = {"copied": [], "linked": []}
    n = 0
    for _ in range(repeats):
        for way, handed_over in (("copied", False), ("linked", True)):
            n += 1
            os.sync()  # start each upload with no dirty pages of the previous one pending
            started = time.perf_counter()
            upload_checkpoint(folder, layout, n, "teacher", parent=None, handed_over=handed_over)
            seconds[way].append(time.perf_counter() - started)
            print(f"{way}: {seconds[way][-1]:.2f} s", flush=True)
            discard_checkpoint(layout, n, "teacher")
    copied, linked = (statistics.median(seconds[w]) for w in ("copied", "linked"))
    print(
        f"{gb:g} GB, medians of {repeats}: copied {copied:.2f} s, linked {linked:.2f} s, "
        f"linked / copied {linked / copied:.2f}"
    )


if __name__ == "__main__":
    main()
