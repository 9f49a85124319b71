"""The run summary in the store (storage/summary.py) marks a run finished for its iterations."""

from __future__ import annotations

import json

import pytest

from storage.errors import CorruptManifestError
from storage.layout import RunLayout
from storage.summary import finished_summary, read_run_summary, write_run_summary


def test_a_run_is_finished_for_the_iterations_its_summary_covers(tmp_path):
    layout = RunLayout(str(tmp_path), "r")
    assert read_run_summary(layout) is None and finished_summary(layout, 2) is None
    write_run_summary(layout, 2, {"after": {"eval/greedy_accuracy": 0.5}})
    assert finished_summary(layout, 2) is None  # LATEST is missing (deleted to be rebuilt): not finished
    layout.store.write_bytes(layout.latest, json.dumps({"iteration": 2}).encode())
    record = finished_summary(layout, 2)
    assert record is not None and record["last_iteration"] == 2 and record["run"] == "r"
    assert record["summary"] == {"after": {"eval/greedy_accuracy": 0.5}}
    assert finished_summary(layout, 1) is not None  # fewer iterations configured: nothing left either
    assert finished_summary(layout, 3) is None  # `iterations` raised: the run goes on


@pytest.mark.parametrize("payload", [b"[]", b'{"last_iteration": "2", "summary": {}}', b'{"last_iteration": 2}'])
def test_a_damaged_record_names_the_file(tmp_path, payload):
    layout = RunLayout(str(tmp_path), "r")
    layout.store.write_bytes(layout.summary_json, payload)
    with pytest.raises(CorruptManifestError, match="summary.json"):
        read_run_summary(layout)
