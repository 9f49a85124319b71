"""The README's `mlflow ui` comparison in a real browser: an SDPO run and its GRPO baseline under one
storage root land in the root's one MLflow store; headless Chromium (Debian's `chromium` and
`chromium-driver`, installed by `make test`) driven by Selenium opens the MLflow UI on that store,
the page comparing the two runs, and the comparison of their `eval/greedy_accuracy`, where both
runs must be plotted.

The screenshots are kept as test artifacts: under the test's tmp dir and copied to
tests/artifacts/mlflow-compare*.png (git-ignored).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.integration.conftest import _free_port, wait_healthy
from tests.integration.runs import write_config

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
METRIC = "eval/greedy_accuracy"

pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="Chromium is not installed: `make test` installs the Debian packages chromium and chromium-driver",
)


def _wait(driver, condition, what: str, timeout: float = 60.0):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.5).until(lambda d: condition(d), message=what)


def _keep(driver, tmp_path: Path, name: str) -> None:
    shot = tmp_path / name
    assert driver.save_screenshot(str(shot))
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(shot, ARTIFACTS / name)


def test_mlflow_ui_compares_an_sdpo_run_with_its_grpo_baseline(tmp_path, prefect_server):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    from flows.run import sdpo_run

    # both runs under one root with the default tracking store: <root>/mlflow.db
    for name, loss in (("ui-sdpo", "sdpo"), ("ui-grpo", "grpo")):
        config = write_config(tmp_path, name, iterations=1, loss={"type": loss}, tracking={"uri": None})
        summary = sdpo_run(str(config), [])
        assert summary["tracking_uri"] == f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"

    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("sdpo").experiment_id
    runs = {r.info.run_name: r.info.run_id for r in client.search_runs([experiment])}
    assert set(runs) == {"ui-sdpo", "ui-grpo"}

    port = _free_port()
    ui = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "ui",
            "--backend-store-uri",
            store,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        stdout=(tmp_path / "mlflow-ui.log").open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1600,1100",
    ):
        options.add_argument(flag)
    driver = None
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(f"{base}/health", ui, tmp_path / "mlflow-ui.log", timeout=120)
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        ids = json.dumps(list(runs.values()))

        driver.get(f"{base}/#/compare-runs?runs={ids}&experiments={json.dumps([experiment])}")
        body = lambda d: d.find_element("tag name", "body").text  # noqa: E731
        _wait(driver, lambda d: "Comparing 2 Runs" in body(d) and "ui-grpo" in body(d), "the comparison page")
        _wait(driver, lambda d: METRIC in body(d), f"{METRIC} on the comparison page")
        assert "ui-sdpo" in body(driver)
        _keep(driver, tmp_path, "mlflow-compare.png")

        keys = quote(json.dumps([METRIC]))
        driver.get(
            f"{base}/#/metric?runs={ids}&metric={quote(json.dumps(METRIC))}&experiments={json.dumps([experiment])}&plot_metric_keys={keys}"
        )
        legend = f"({METRIC})"
        _wait(
            driver,
            lambda d: f"ui-sdpo {legend}" in body(d) and f"ui-grpo {legend}" in body(d),
            "both runs in the plot's legend",
        )
        drawn = lambda d: [  # noqa: E731  the lines plotly drew: a path through at least two points
            p.get_attribute("d")
            for p in d.find_elements("css selector", ".scatterlayer .trace path.js-line")
            if "L" in (p.get_attribute("d") or "")
        ]
        _wait(driver, lambda d: len(drawn(d)) >= 2, "a line per run (before -> after)")
        _keep(driver, tmp_path, "mlflow-compare-metric.png")
    finally:
        if driver is not None:
            driver.quit()
        os.killpg(ui.pid, signal.SIGKILL)
        ui.wait(timeout=30)
