"""A prepared prompt-data row, and the two errors about rows: one a converter raises (`BadRow`, no
location) and the one the user sees (`InvalidRowError`, with the file and line)."""

from __future__ import annotations

from typing import Any

Row = dict[str, Any]


class InvalidRowError(ValueError):
    """A malformed input row; `where` is "file:line" (or "file: row k")."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.where, self.reason = where, reason


class BadRow(ValueError):
    """Raised by a converter for a malformed row; the driver adds the location."""
