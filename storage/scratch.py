"""Temporary files and folders that a crash may leave behind, and the sweep that removes them.

Every temporary name this project creates carries its owner, `+<host>+<pid>+<random>`: an object
store write's `.LATEST.tmp+h+42+ab12`, a checkpoint download `.<digest>.tmp+h+42+ab12`, a
checkpoint being written `<cache>/tmp/ckpt+h+42+ab12/`, an S3 shard spool `sdpo-shard+h+42+ab12`.
A normal exit or an exception removes them where they were made; a SIGKILL cannot, so `sweep`
removes, on the next start, every such entry whose owner is a process of this host that no longer
exists. Entries of live processes (another run sharing the cache) and of other hosts are left alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

_OWNER = re.compile(r"\+(?P<host>[^+/]+)\+(?P<pid>[0-9]+)\+[0-9a-f]{12}(?:$|[.+])")


def owner_tag() -> str:
    """`+<host>+<pid>+<random>`: the suffix that makes a temporary name sweepable."""
    return f"+{socket.gethostname()}+{os.getpid()}+{uuid.uuid4().hex[:12]}"


def tmp_sibling(path: str) -> str:
    """A temporary name beside `path` (same folder, so a rename into place is atomic)."""
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp{owner_tag()}")


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def is_orphan(name: str) -> bool:
    """Whether `name` is a temporary entry whose owner process (on this host) is gone."""
    match = _OWNER.search(name)
    if match is None:
        return False
    return match.group("host") == socket.gethostname() and not pid_alive(int(match.group("pid")))


def sweep(folder: str | os.PathLike[str], *, depth: int = 1) -> list[Path]:
    """Remove the orphaned temporary entries in `folder` down to `depth` levels; returns them."""
    root = Path(folder)
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    level = [root]
    for _ in range(depth):
        below: list[Path] = []
        for parent in level:
            with contextlib.suppress(FileNotFoundError):  # a concurrent sweep removed it first
                for entry in parent.iterdir():
                    if is_orphan(entry.name):
                        if entry.is_dir() and not entry.is_symlink():
                            shutil.rmtree(entry, ignore_errors=True)
                        else:
                            entry.unlink(missing_ok=True)
                        removed.append(entry)
                    elif entry.is_dir() and not entry.is_symlink():
                        below.append(entry)
        level = below
    if removed:
        logger.warning(
            "removed %d temporary entr%s left by crashed processes under %s: %s",
            len(removed),
            "y" if len(removed) == 1 else "ies",
            root,
            [str(p) for p in removed[:5]],
        )
    return removed


def sweep_local(cache_dir: str | os.PathLike[str], run_dir: str | os.PathLike[str] | None) -> list[Path]:
    """The start-of-run sweep: the run folder (local stores), the cache and the system temp folder."""
    removed = sweep(cache_dir, depth=3)
    if run_dir is not None:
        removed += sweep(run_dir, depth=6)
    removed += sweep(tempfile.gettempdir(), depth=1)
    return removed


@contextlib.contextmanager
def scratch_dir(cache_dir: str | os.PathLike[str], prefix: str) -> Iterator[Path]:
    """A fresh folder `<cache_dir>/tmp/<prefix>+host+pid+rand/`, removed on exit (swept after a kill)."""
    base = Path(cache_dir) / "tmp"
    base.mkdir(parents=True, exist_ok=True)
    path = base / f"{prefix}{owner_tag()}"
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def spool_file(prefix: str, suffix: str = "", *, folder: str | None = None) -> tuple[int, str]:
    """`mkstemp` under a sweepable name, in `folder` or the system temp folder: (fd, path)."""
    return tempfile.mkstemp(prefix=f"sdpo-{prefix}{owner_tag()}+", suffix=suffix, dir=folder)
