"""Who wrote a record and when: UTC timestamps and the code version stamped into run.json and manifests."""

from __future__ import annotations

import datetime as dt
import functools
import importlib.metadata
import shutil
import subprocess
from pathlib import Path

PACKAGE = "sdpo-pipeline"


def utc_now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


@functools.cache
def code_version() -> str:
    """`git describe` of the source tree when it is a git checkout with commits, else the package version."""
    git = shutil.which("git")
    if git is not None:
        source = Path(__file__).resolve().parent.parent
        result = subprocess.run(
            [git, "-C", str(source), "describe", "--always", "--dirty", "--tags"],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode == 0 and result.stdout.strip():
            return f"git:{result.stdout.strip()}"
    return f"{PACKAGE}=={importlib.metadata.version(PACKAGE)}"
