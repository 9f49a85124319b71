"""A new Prefect home starts from an already-migrated database.

Without `PREFECT_API_URL` every run uses Prefect's ephemeral server on its own home
(`flows.cli.app.prefect_local_mode`). On a home without a database that server first creates
one by running every Alembic migration, which takes about as long again as the server's own
start (on a 2-core machine: 18-21 s to the first flow run against 9-11 s with a migrated
database). The migrated, empty database depends only on Prefect's version, so it is made once
per version with Prefect's own `prefect server database upgrade` into a template under the user
cache (`$XDG_CACHE_HOME/sdpo`, else `~/.cache/sdpo`) and copied into each new home. The
template never holds a run: it is built in a folder of its own and only copied from.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

DB_NAME = "prefect.db"  # Prefect's default database file inside PREFECT_HOME


def template_dir() -> Path:
    from prefect import __version__

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "sdpo" / f"prefect-{__version__}"


def _build_template(target: Path) -> None:
    """Run Prefect's migrations into a fresh home and move the database to `target` (atomic:
    builders racing each other each leave a complete file)."""
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as build:
        env = {**os.environ, "PREFECT_HOME": build}
        env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)
        command = [sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        built = Path(build, DB_NAME)
        if done.returncode != 0 or not built.is_file():
            raise RuntimeError(
                f"`prefect server database upgrade` exited with {done.returncode} building the database "
                f"template in {target.parent}: {(done.stderr or done.stdout)[-2000:]}"
            )
        os.replace(built, target)


def seed_home(home: Path) -> bool:
    """Give `home` a copy of the migrated template database when it has no database yet.

    Returns whether it copied one. Nothing is done when `PREFECT_API_DATABASE_CONNECTION_URL`
    names another database, or when the home already has one (a resumed run keeps its history).
    """
    if os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL"):
        return False
    database = home / DB_NAME
    if database.exists():
        return False
    template = template_dir() / DB_NAME
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # e.g. a read-only home: Prefect's server migrates the new database itself
        logger.warning("no Prefect database template (%s); the server will create the database", err)
        return False
    if not template.is_file():
        logger.info("building Prefect's migrated database template in %s (once per Prefect version)", template.parent)
        _build_template(template)
    home.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=home, prefix=".prefect-db-") as partial:
        with template.open("rb") as source:
            shutil.copyfileobj(source, partial)
        partial.flush()
        try:  # never over a database another process created meanwhile (its server may be using it)
            os.link(partial.name, database)
        except FileExistsError:
            return False
    return True
