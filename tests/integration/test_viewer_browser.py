"""The web viewer in a real browser: headless Chromium (Debian's `chromium` and `chromium-driver`,
installed by `make test`) driven by Selenium against the app served by uvicorn on 127.0.0.1.

The screenshot of the opened sample is kept as a test artifact: under the test's tmp dir and copied
to tests/artifacts/viewer.png (git-ignored).
"""

from __future__ import annotations

import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.viewer.app import create_app
from tasks.viewer.data import RunData
from tests.synthetic import write_synthetic_run

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
G = 4

pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="Chromium is not installed: `make test` installs the Debian packages chromium and chromium-driver",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(root: Path, name: str) -> Iterator[str]:
    import uvicorn

    port = _free_port()
    app = create_app(RunData(str(root / "runs"), name))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start within 30 s"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("browser")
    write_synthetic_run(str(root / "runs"), "tiny", local_dir=root, rows=24, group_size=G, seed=0)
    yield from _serve(root, "tiny")


@pytest.fixture(scope="module")
def srpo_server(tmp_path_factory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("browser-srpo")
    overrides = ("loss.type=srpo",)
    write_synthetic_run(str(root / "runs"), "srpo", local_dir=root, rows=24, group_size=G, seed=2, overrides=overrides)
    yield from _serve(root, "srpo")


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,900",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_window_size(1400, 900)
    yield driver
    driver.quit()


def _wait(driver, condition, what: str, timeout: float = 20.0):
    """Wait for `condition`; an element replaced while it was read (stale) is read again at the next poll."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, ignored_exceptions=(StaleElementReferenceException,)).until(
        lambda d: condition(d), message=what
    )


def test_sort_open_a_sample_and_see_credit_and_teacher_context(server, browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    browser.get(server)
    _wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "tr.sample-row")) == 24, "the sample list")

    browser.find_element(By.CSS_SELECTOR, 'th[data-sort="reward"]').click()  # reward, highest first

    def rewards(d) -> list[float]:  # read in one script: the rows are replaced while the page reloads
        return d.execute_script(
            "return [...document.querySelectorAll('tr.sample-row')].map((r) => Number(r.dataset.reward));"
        )

    _wait(
        browser,
        lambda d: (r := rewards(d)) == sorted(r, reverse=True) and r[0] > r[-1],
        "the list sorted by reward, descending",
    )
    # the best-rewarded sample that is trained on: its teacher saw a peer's answer
    row = next(r for r in browser.find_elements(By.CSS_SELECTOR, "tr.sample-row") if "trained" in r.text)
    sample_id = row.get_attribute("data-sample-id")
    row.click()

    tokens = _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#tokens .tok"), "the per-token view")
    credits = [float(t.get_attribute("data-credit")) for t in tokens]
    colours = [t.value_of_css_property("background-color") for t in tokens]
    assert len(tokens) > 5 and any(abs(c) > 0.05 for c in credits)
    white = "rgba(255, 255, 255, 1)"
    coloured = [colour for colour, credit in zip(colours, credits, strict=True) if abs(credit) > 0.2]
    assert coloured and all(colour not in (white, "rgba(0, 0, 0, 0)") for colour in coloured)
    positive = [c for c, k in zip(colours, credits, strict=True) if k > 0.2]
    negative = [c for c, k in zip(colours, credits, strict=True) if k < -0.2]
    if positive and negative:  # green for credit, red for blame
        g_pos = [int(x) for x in positive[0][5:-1].split(",")[:3]]
        g_neg = [int(x) for x in negative[0][5:-1].split(",")[:3]]
        assert g_pos[1] > g_pos[0] and g_neg[0] > g_neg[1]

    context = browser.find_element(By.ID, "teacher-context").text
    assert "teacher source solution" in context and "Correct solution:" in context
    assert "demonstration sample " in context
    assert browser.find_element(By.ID, "mask-reason").text.startswith(("trained on", "masked"))
    assert f"Sample {sample_id}" in browser.find_element(By.CSS_SELECTOR, "#detail h2").text

    ActionChains(browser).move_to_element(tokens[3]).perform()
    tip = _wait(
        browser,
        lambda d: d.find_element(By.ID, "tooltip") if d.find_element(By.ID, "tooltip").is_displayed() else None,
        "the top-K tooltip",
    )
    assert (
        "student p" in tip.text and "teacher p" in tip.text and len(tip.find_elements(By.CSS_SELECTOR, "tr")) == 1 + 8
    )

    shot = tmp_path / "viewer.png"
    assert browser.save_screenshot(str(shot))
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(shot, ARTIFACTS / "viewer.png")

    browser.find_element(By.ID, "open-group").click()
    members = _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#group .member"), "the group view")
    assert len(members) == G
    demos = browser.find_elements(By.CSS_SELECTOR, "#group .member.demo")
    assert demos and all("demonstration" in m.text for m in demos)
    browser.save_screenshot(str(tmp_path / "group.png"))
    shutil.copy(tmp_path / "group.png", ARTIFACTS / "viewer-group.png")


def test_an_srpo_run_shows_routes_and_colours_tokens_by_entropy_weight(srpo_server, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    browser.get(srpo_server)
    _wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "tr.sample-row")) == 24, "the sample list")
    routes = [td.text for td in browser.find_elements(By.CSS_SELECTOR, "tr.sample-row td.route")]
    assert set(routes) == {"SDPO", "GRPO"}
    assert "routed to SDPO" in browser.find_element(By.ID, "summary").text

    Select(browser.find_element(By.ID, "route")).select_by_value("sdpo")
    _wait(
        browser,
        lambda d: len(d.find_elements(By.CSS_SELECTOR, "tr.sample-row")) == routes.count("SDPO"),
        "the list of samples routed to SDPO",
    )
    browser.find_element(By.CSS_SELECTOR, "tr.sample-row").click()
    _wait(browser, lambda d: d.find_elements(By.ID, "colour"), "the colour choice of an SDPO-routed sample")
    assert browser.find_element(By.ID, "route-reason").text.startswith("SDPO: it failed")
    Select(browser.find_element(By.ID, "colour")).select_by_value("weight")
    read = """
        const view = document.getElementById('tokens');
        if (!view || view.dataset.colour !== 'weight') return null;
        return [...document.querySelectorAll('#tokens .tok')].map((t) =>
            [Number(t.dataset.weight), getComputedStyle(t).backgroundColor]);
    """
    shown = _wait(browser, lambda d: d.execute_script(read), "the tokens coloured by entropy weight")
    weights = [w for w, _ in shown]
    blues = [[int(x) for x in colour[colour.index("(") + 1 : -1].split(",")[:3]] for _, colour in shown]
    assert weights and all(w > 0 for w in weights)
    # blue deepens with the weight: the red channel falls as the weight grows
    heavy, light = weights.index(max(weights)), weights.index(min(weights))
    assert blues[heavy][0] <= blues[light][0] and all(b[2] >= b[0] for b in blues)
    browser.save_screenshot(str(tmp_path / "srpo.png"))
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(tmp_path / "srpo.png", ARTIFACTS / "viewer-srpo.png")
