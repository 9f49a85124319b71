"""The run summary in the store: written last, once a run's last iteration is committed, evaluated,
logged and its summary published; its presence says the run is finished.

```
<root>/<run>/summary.json   {run, last_iteration, written_at, summary}
```

A flow that finds the run finished for its configured iterations has nothing left to do (and
publishes no second summary); one killed before the record is written finishes the run again.
Raising `iterations` (an accepted config change) makes the run unfinished until its new last
iteration writes the record again.
"""

from __future__ import annotations

import json
from typing import Any

from storage.errors import CorruptManifestError
from storage.layout import RunLayout
from storage.manifest import decode_json_object, read_latest
from storage.provenance import utc_now


def write_run_summary(layout: RunLayout, last_iteration: int, summary: dict[str, Any]) -> None:
    """Record that the run is finished at iteration `last_iteration`, with its summary."""
    record = {"run": layout.run_name, "last_iteration": last_iteration, "written_at": utc_now(), "summary": summary}
    layout.store.write_bytes(layout.summary_json, json.dumps(record, indent=2, sort_keys=True).encode())


def read_run_summary(layout: RunLayout) -> dict[str, Any] | None:
    """The stored record ({run, last_iteration, written_at, summary}), or None before the run finished."""
    if not layout.store.exists(layout.summary_json):
        return None
    record = decode_json_object(layout.summary_json, layout.store.read_bytes(layout.summary_json))
    last = record.get("last_iteration")
    if not isinstance(last, int) or isinstance(last, bool) or not isinstance(record.get("summary"), dict):
        raise CorruptManifestError(
            f"{layout.summary_json}: expected an int 'last_iteration' and an object 'summary', "
            f"got {last!r} and {type(record.get('summary')).__name__}"
        )
    return record


def finished_summary(layout: RunLayout, iterations: int) -> dict[str, Any] | None:
    """The stored record when the run is finished for `iterations` (its summary covers them and
    LATEST names them: a LATEST deleted to be rebuilt makes the run unfinished), else None."""
    record = read_run_summary(layout)
    if record is None or record["last_iteration"] < iterations or (read_latest(layout) or 0) < iterations:
        return None
    return record
