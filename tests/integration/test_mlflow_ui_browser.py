"""The MLflow comparison of docs/operating.md in a real browser: an SDPO run, its GRPO baseline and a
fork of the SDPO run under one storage root land in the root's one MLflow store. The runs folder is
then moved elsewhere, and `sdpo mlflow-ui` starts the UI on it at a port of its own, saying that it
rewrote the store's artifact locations. Headless Chromium (Debian's `chromium` and `chromium-driver`,
installed by `make test`) driven by Selenium, its localStorage empty as a new browser's (where MLflow
3.17's UI keeps its GenAI / Model training toggle, GenAI by default), opens every link the pipeline
prints or stores: the experiment's runs (printed by `sdpo mlflow-ui` and `sdpo run`), a run (the
Prefect artifacts' link) and the parent a fork's description links to; each lands on the training
view at that port. The moved run's artifacts are listed; the runs table lists the fork as a run of
its own (not folded under its parent), named with the setting it changed, and its line is in the
charts without expanding anything; the comparison of two runs plots `eval/greedy_accuracy` for both.

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
    where the browser was and what it showed. The single-page app re-renders while it loads, so an
    element read mid-render (stale) is read again at the next poll rather than failing the test."""
    from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(
            driver, timeout, poll_frequency=0.5, ignored_exceptions=(StaleElementReferenceException,)
        ).until(lambda d: condition(d), message=what)
    except TimeoutException:
        ARTIFACTS.mkdir(exist_ok=True)
        driver.save_screenshot(str(ARTIFACTS / "mlflow-timeout.png"))
        shown = driver.find_element("tag name", "body").text[:1500]
        raise AssertionError(
            f"{what}: not seen in {timeout:.0f}s at {driver.current_url}; the page shows:\n{shown}"
        ) from None


def _type(field, text: str) -> bool:
    """Replace what `field` holds with `text` (whole, so a retry after a re-render types it once)."""
    field.clear()
    field.send_keys(text)
    return True


def _keep(driver, tmp_path: Path, name: str) -> None:
    shot = tmp_path / name
    assert driver.save_screenshot(str(shot))
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(shot, ARTIFACTS / name)


def _training_view(driver, what: str) -> None:
    """The page shows the UI's training chrome (its sidebar's "Model registry"), not the GenAI one
    (whose sidebar has "Observability" and "Playground"), and its address says so."""
    body = lambda d: d.find_element("tag name", "body").text  # noqa: E731
    _wait(
        driver, lambda d: "Model registry" in body(d) and "Observability" not in body(d), f"{what}: the training view"
    )
    assert "workflowType=machine_learning" in driver.current_url, driver.current_url


def _fresh(driver, link: str) -> None:
    """Open `link` with the UI's localStorage as a new browser has it (no workflow chosen)."""
    driver.get(link.split("#")[0])
    driver.execute_script("window.localStorage.clear()")
    driver.get(link)
    driver.refresh()  # a page load, not the single-page app's navigation: its state read afresh


def test_mlflow_ui_opens_every_link_on_the_training_view_after_the_runs_folder_moved(tmp_path, prefect_server):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    from flows.cli.tracking import ui_commands
    from flows.run import sdpo_run
    from tasks.config import load_config

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
    fork_name = "ui-fork (fork of ui-sdpo at 1: iterations 1 -> 2; optimizer.lr 0.001 -> 0.002)"

    # the runs folder moves, with its store and artifacts; the UI starts on a port of its own
    moved = tmp_path / "elsewhere" / "runs"
    shutil.move(tmp_path / "runs", moved)
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{moved / 'mlflow.db'}"
    port = _free_port()
    log = tmp_path / "mlflow-ui.log"
    ui = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "mlflow-ui", "--root", str(moved), "--port", str(port)],
        stdout=log.open("wb"),
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
        wait_healthy(f"{base}/health", ui, log, timeout=120)
        client = MlflowClient(store)
        experiment = client.get_experiment_by_name("sdpo").experiment_id
        everything = {r.data.tags["sdpo.run_url"].rsplit("/", 1)[1]: r for r in client.search_runs([experiment])}
        assert set(everything) == {"ui-sdpo", "ui-grpo", "ui-fork"}
        assert everything["ui-fork"].info.run_name == fork_name
        ids = {name: run.info.run_id for name, run in everything.items()}
        printed = log.read_text()
        assert f"was moved from {tmp_path / 'runs'}: rewrote" in printed, printed
        experiment_link = f"{base}/#/experiments/{experiment}/runs?workflowType=machine_learning"
        assert f"experiment sdpo: {experiment_link}" in printed, printed
        # what `sdpo run` prints for a UI on this port (tracking.ui_url) is the same address
        cfg = load_config(fork_yaml, [f"tracking.ui_url={base}", f"storage.root={moved}"])
        assert ui_commands(cfg, experiment) == [
            f"sdpo mlflow-ui --root {moved} --port {port}",
            f"then open {experiment_link}",
        ]

        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        body = lambda d: d.find_element("tag name", "body").text  # noqa: E731
        drawn = lambda d: [  # noqa: E731  the lines plotly drew: a path through at least two points
            p.get_attribute("d")
            for p in d.find_elements("css selector", ".scatterlayer .trace path.js-line")
            if "L" in (p.get_attribute("d") or "")
        ]

        # the experiment's runs: every run, the fork one of them beside its parent (not folded under it)
        _fresh(driver, experiment_link)
        _training_view(driver, "the printed experiment link")
        _wait(driver, lambda d: all(n in body(d) for n in ("ui-sdpo", "ui-grpo", "fork of ui-sdpo")), "every run")
        _keep(driver, tmp_path, "mlflow-training-view.png")

        # a run (the Prefect artifacts' link): its artifacts found where the folder moved to
        from flows.artifacts import mlflow_run_link

        fork_id = ids["ui-fork"]
        link = mlflow_run_link(SimpleNamespace(enabled=True, ui_url=base, experiment_id=experiment, run_id=fork_id))
        _fresh(driver, link)
        _training_view(driver, "the run link of the Prefect artifacts")
        _wait(driver, lambda d: "Model metrics" in body(d), "the fork's run page")
        _keep(driver, tmp_path, "mlflow-fork-run.png")
        driver.get(link.replace("?", "/artifacts?"))
        _wait(driver, lambda d: "summary.json" in body(d) and "config.json" in body(d), "the moved run's artifacts")

        # the link in the fork's description opens its parent, in the training view too
        _fresh(driver, link)
        _wait(driver, lambda d: "Forked from" in body(d), "the fork's description")
        parent_link = _wait(
            driver, lambda d: d.find_element("link text", "ui-sdpo").get_attribute("href"), "the parent's link"
        )
        assert parent_link.startswith(f"{base}/#/experiments/{experiment}/runs/{ids['ui-sdpo']}"), parent_link
        _fresh(driver, parent_link)
        _training_view(driver, "the parent link of the fork's description")

        # the fork's line in the charts, named with what it changed, beside its parent's and the baseline's
        _fresh(driver, experiment_link + "&compareRunsMode=CHART")
        _wait(  # the one chart of the metric: a line for each of the three runs
            driver,
            lambda d: _type(d.find_element("css selector", "input[placeholder='Search metric charts']"), METRIC),
            "the charts' search box",
        )
        _wait(
            driver,
            lambda d: len(drawn(d)) >= 3 and "fork of ui-sdpo" in body(d),
            f"the fork's line in the {METRIC} chart, beside its parent's and the baseline's",
        )
        _keep(driver, tmp_path, "mlflow-training-charts.png")

        pair = json.dumps([ids["ui-sdpo"], ids["ui-grpo"]])
        driver.get(f"{base}/#/compare-runs?runs={pair}&experiments={json.dumps([experiment])}")
        _wait(driver, lambda d: "Comparing 2 Runs" in body(d) and "ui-grpo" in body(d), "the comparison page")
        _wait(driver, lambda d: METRIC in body(d), f"{METRIC} on the comparison page")
        _wait(driver, lambda d: "ui-sdpo" in body(d), "the other run on the comparison page")
        _keep(driver, tmp_path, "mlflow-compare.png")

        keys = quote(json.dumps([METRIC]))
        driver.get(
            f"{base}/#/metric?runs={pair}&metric={quote(json.dumps(METRIC))}&experiments={json.dumps([experiment])}&plot_metric_keys={keys}"
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
