"""Bootstrapped base models shipped with the product, so `make demo` starts training at once.

A bootstrapped policy (`tasks.data.bootstrap`) is a function of its settings and seed; building it
costs a supervised warm-up (about a minute on two cores for the demo's), which every newcomer would
wait for before the first iteration. The product ships the demo's: the folder `sdpo run` would
build for configs/demo.yaml, under `tasks/data/base_models/<key>/`, where `<key>` is the
bootstrap cache key of its settings (`tasks.prepare_base.bootstrap_cache_dir`), with `SHA256SUMS`
listing every file. A run whose settings have that key copies the folder into its cache, each file
checked against its digest, instead of warming up a model; any other settings bootstrap as before.

When the warm-up or the demo's settings change, write the folder again:

    .venv/bin/python -m tasks.prepare_base configs/demo.yaml
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

SHIPPED = Path(__file__).with_name("base_models")
SUMS = "SHA256SUMS"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def shipped_folder(key: str) -> Path | None:
    """The shipped base model of bootstrap cache key `key`, or None."""
    folder = SHIPPED / key
    return folder if (folder / SUMS).is_file() else None


def copy_shipped(source: Path, target: Path) -> None:
    """Copy a shipped base model into `target` (a fresh folder), each file checked against its
    listed sha256: a file that differs (a damaged checkout) stops the copy, naming it."""
    listed = dict(line.split(maxsplit=1)[::-1] for line in (source / SUMS).read_text().splitlines() if line.strip())
    present = sorted(p.name for p in source.iterdir() if p.name != SUMS)
    if sorted(listed) != present:
        raise RuntimeError(f"{source} holds {present}, but its {SUMS} lists {sorted(listed)}")
    for name, digest in sorted(listed.items()):
        if _digest(source / name) != digest:
            raise RuntimeError(
                f"{source / name} does not have the sha256 its {SUMS} lists ({digest[:12]}): the checkout is "
                "damaged; restore it (git checkout -- tasks/data/base_models) or remove the folder to bootstrap"
            )
        shutil.copyfile(source / name, target / name)


def write_shipped(folder: Path, key: str) -> Path:
    """Ship the bootstrapped base model in `folder` under `key`: its files and their SHA256SUMS."""
    out = SHIPPED / key
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    for name in names:
        shutil.copyfile(folder / name, out / name)
    (out / SUMS).write_text("".join(f"{_digest(out / name)}  {name}\n" for name in names))
    return out
