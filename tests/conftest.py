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


def pytest_unconfigure(config: pytest.Config) -> None:
    # A Prefect server started in a test process stops at its exit and logs so to a stream pytest
    # has closed by then, which printed a `--- Logging error ---` traceback after the summary.
    import logging

    logging.getLogger("prefect").disabled = True
