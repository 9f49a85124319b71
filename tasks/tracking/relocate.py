"""An MLflow store that moved with its runs folder: where its artifacts are, rewritten.

The store beside a local run root (`<root>/mlflow.db`, `tasks.tracking.experiment.tracking_uri`)
keeps its artifacts beside it (`<root>/mlartifacts`), and MLflow records where as absolute
`file://` URIs: an experiment's artifact location, each run's artifact URI, each logged model's
location. It also holds the SDPO run's own URL as a tag (`sdpo.run_url`), by which the tracker finds
the MLflow run of a run it resumes. Copy or move the runs folder and all of them still name the old
place: the UI lists no artifacts (or a copy's UI shows the original's), and a resumed run would start
a second MLflow run.

`relocate_store` rewrites them in one transaction, from the old folder to the one the store is in
now, and says what it rewrote. MLflow has no call that changes where an experiment or a run keeps its
artifacts, so this writes MLflow's tables (`experiments`, `runs`, `logged_models`, `model_versions`,
`tags`) directly; only values under the old folder change. The tracker calls it when it opens the
store, and `sdpo mlflow-ui` before it starts the UI.
"""

from __future__ import annotations

import contextlib
import sqlite3
from dataclasses import dataclass
from pathlib import Path

ARTIFACTS_DIR = "mlartifacts"  # beside the store: `<root>/mlartifacts`
# (table, column) pairs that hold artifact URIs under the artifacts folder
_URI_COLUMNS = (
    ("runs", "artifact_uri"),
    ("logged_models", "artifact_location"),
    ("model_versions", "storage_location"),
    ("model_versions", "source"),
)


@dataclass(frozen=True)
class Relocation:
    """A store moved from `old` (the runs folder it was created in) to `new`: `rows` values rewritten."""

    db: Path
    old: Path
    new: Path
    rows: int

    def describe(self) -> str:
        return (
            f"MLflow store {self.db} was moved from {self.old}: rewrote {self.rows} artifact locations and run "
            f"URLs to {self.new}"
        )


def artifacts_uri(db: Path) -> str:
    """Where the store at `db` keeps its artifacts: `<folder of db>/mlartifacts`, as a file URI."""
    return (db.parent / ARTIFACTS_DIR).resolve().as_uri()


def relocate_store(db: Path) -> Relocation | None:
    """Rewrite the artifact locations and SDPO run URLs the store at `db` records under the folder it
    was created in to the folder it is in now, and say so (`Relocation.describe`); None when it has
    not moved (or has no experiment with its artifacts beside it)."""
    new_uri = artifacts_uri(db)
    with contextlib.closing(sqlite3.connect(db)) as connection, connection:  # one transaction
        old_uris = {
            uri
            for (uri,) in connection.execute("SELECT artifact_location FROM experiments")
            if uri is not None and uri.startswith("file://") and uri.endswith(f"/{ARTIFACTS_DIR}") and uri != new_uri
        }
        if not old_uris:
            return None
        if len(old_uris) > 1:
            raise ValueError(
                f"MLflow store {db}: experiments keep artifacts in several old folders: {sorted(old_uris)}"
            )
        (old_uri,) = old_uris
        old_root, new_root = old_uri.removesuffix(f"/{ARTIFACTS_DIR}"), new_uri.removesuffix(f"/{ARTIFACTS_DIR}")
        tables = {name for (name,) in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        rows = connection.execute(
            "UPDATE experiments SET artifact_location = ? WHERE artifact_location = ?", (new_uri, old_uri)
        ).rowcount
        for table, column in _URI_COLUMNS:
            if table in tables:
                rows += _replace_prefix(connection, table, column, f"{old_uri}/", f"{new_uri}/")
        # the SDPO run URLs (`sdpo.run_url`, a fork's `sdpo.parent_run_url`, ...) in the runs' tags
        rows += _replace_prefix(connection, "tags", "value", f"{old_root}/", f"{new_root}/", keys="sdpo.%")
    return Relocation(db, Path(old_root.removeprefix("file://")), Path(new_root.removeprefix("file://")), rows)


def _replace_prefix(
    connection: sqlite3.Connection, table: str, column: str, old: str, new: str, *, keys: str | None = None
) -> int:
    """Replace the prefix `old` of `table.column` values by `new` (in tags whose key is LIKE `keys`)."""
    where = f"substr({column}, 1, ?) = ?" + (" AND key LIKE ?" if keys is not None else "")
    args: tuple[object, ...] = (new, len(old) + 1, len(old), old) + ((keys,) if keys is not None else ())
    return connection.execute(f"UPDATE {table} SET {column} = ? || substr({column}, ?) WHERE {where}", args).rowcount
