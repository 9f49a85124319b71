"""The `mlflow ui` comparison of docs/operating.md in a real browser: an SDPO run and its GRPO baseline under one
storage root land in the root's one MLflow store; headless Chromium (Debian's `chromium` and
`chromium-driver`, installed by `make test`) driven by Selenium opens the MLflow UI on that store,
the page comparing the two runs, and the comparison of their `eval/greedy_accuracy`, where both
runs must be plotted. With a fork of the SDPO run beside them, the run link the pipeline writes
opens in the UI's training view, the experiment's runs table there lists the fork as a run of its
own (not folded under its parent), and the fork's line is in the charts without expanding anything.

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
from types import SimpleNamespace
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
    """Wait for `condition`; on a timeout, keep the page (tests/artifacts/mlflow-timeout.png) and say
    where the browser was and what it showed."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.5).until(lambda d: condition(d), message=what)
    except TimeoutException:
        ARTIFACTS.mkdir(exist_ok=True)
        driver.save_screenshot(str(ARTIFACTS / "mlflow-timeout.png"))
        shown = driver.find_element("tag name", "body").text[:1500]
        raise AssertionError(
            f"{what}: not seen in {timeout:.0f}s at {driver.current_url}; the page shows:\n{shown}"
        ) from None


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
    # and a fork of the SDPO run, one iteration further, with another learning rate
    from typer.testing import CliRunner

    from flows.cli import app

    fork_yaml = tmp_path / "ui-fork.yaml"
    forked = CliRunner().invoke(
        app,
        ["fork", "ui-sdpo", "--from-iteration", "1", "--name", "ui-fork", "--root", str(tmp_path / "runs")]
        + ["--config-out", str(fork_yaml), "iterations=2", "optimizer.lr=0.002"],
    )
    assert forked.exit_code == 0, forked.output
    sdpo_run(str(fork_yaml), [])

    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("sdpo").experiment_id
    everything = {r.info.run_name: r.info.run_id for r in client.search_runs([experiment])}
    assert set(everything) == {"ui-sdpo", "ui-grpo", "ui-fork"}
    runs = {name: everything[name] for name in ("ui-sdpo", "ui-grpo")}

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
        body = lambda d: d.find_element("tag name", "body").text  # noqa: E731
        drawn = lambda d: [  # noqa: E731  the lines plotly drew: a path through at least two points
            p.get_attribute("d")
            for p in d.find_elements("css selector", ".scatterlayer .trace path.js-line")
            if "L" in (p.get_attribute("d") or "")
        ]

        # the run page the pipeline links to (Prefect artifacts) opens in the training view, and so
        # does the experiment from there: the runs, the fork one of them beside its parent (not
        # folded under it), and its curve in the charts without expanding anything
        from flows.artifacts import mlflow_run_link

        fork_id = everything["ui-fork"]
        link = mlflow_run_link(SimpleNamespace(enabled=True, ui_url=base, experiment_id=experiment, run_id=fork_id))
        driver.get(link)
        _wait(driver, lambda d: "ui-fork" in body(d) and "Model metrics" in body(d), "the fork's run page")
        _keep(driver, tmp_path, "mlflow-fork-run.png")
        driver.get(link.replace(f"/runs/{fork_id}", ""))
        _wait(driver, lambda d: all(n in body(d) for n in everything), "every run in the training view's table")
        assert f"/experiments/{experiment}/runs" in driver.current_url, driver.current_url
        assert "workflowType=machine_learning" in driver.current_url, driver.current_url
        _keep(driver, tmp_path, "mlflow-training-view.png")
        driver.get(driver.current_url + "&compareRunsMode=CHART")
        search = _wait(
            driver,
            lambda d: d.find_elements("css selector", "input[placeholder='Search metric charts']"),
            "the charts' search box",
        )[0]
        search.send_keys(METRIC)  # the one chart of the metric: a line for each of the three runs
        _wait(
            driver,
            lambda d: len(drawn(d)) >= 3 and f"ui-fork ({METRIC})" in body(d),
            f"the fork's line in the {METRIC} chart, beside its parent's and the baseline's",
        )
        _keep(driver, tmp_path, "mlflow-training-charts.png")

        driver.get(f"{base}/#/compare-runs?runs={ids}&experiments={json.dumps([experiment])}")
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
        _wait(driver, lambda d: len(drawn(d)) >= 2, "a line per run (before -> after)")
        _keep(driver, tmp_path, "mlflow-compare-metric.png")
    finally:
        if driver is not None:
            driver.quit()
        os.killpg(ui.pid, signal.SIGKILL)
        ui.wait(timeout=30)
