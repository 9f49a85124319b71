"""Suite-wide settings: quiet, offline, single-threaded torch, and one Prefect test server."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

import pytest


@pytest.fixture(scope="session")
def prefect_server():
    """A throw-away Prefect API (temporary SQLite) shared by every flow test; yields its URL."""
    from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            yield PREFECT_API_URL.value()


# The longest test files, longest first (`--durations` of the whole suite on 2 cores): they start
# first, so that with `-n 2 --dist loadfile` no worker begins a long file while the other finishes.
LONGEST_FIRST = (
    "tests/integration/test_crash_resume.py",
    "tests/integration/test_prefect_deployments.py",
    "tests/integration/test_audit_anchor.py",
    "tests/integration/test_launchers.py",
    "tests/integration/test_async_iterations.py",
    "tests/integration/test_process_lifetime.py",
    "tests/integration/test_prefect_cancel.py",
    "tests/integration/test_prefect_operating.py",
    "tests/integration/test_exact_resume.py",
    "tests/integration/test_test_time.py",
    "tests/integration/test_mlflow_ui_browser.py",
    "tests/integration/test_smoke.py",  # the one long test of `make test-fast`
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    root = config.rootpath

    def order(item: pytest.Item) -> int:
        return rank.get(item.path.relative_to(root).as_posix(), len(rank))

    items.sort(key=order)  # stable: the order within a file, and of the other files, is kept


def pytest_unconfigure(config: pytest.Config) -> None:
    # A Prefect server started in a test process stops at its exit and logs so to a stream pytest
    # has closed by then, which printed a `--- Logging error ---` traceback after the summary.
    import logging

    logging.getLogger("prefect").disabled = True
