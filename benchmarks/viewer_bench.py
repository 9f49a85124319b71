"""`sdpo view` on a synthetic 20k-sample iteration: first paint and page times, API and browser.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/viewer_bench.py [--rows 20000] [--top-k 16]

Writes a run (default config, the demo tokenizer as the policy checkpoint, committed rollout and
teacher stages made by `tests.synthetic.write_synthetic_run`) to a temporary directory, serves it
with uvicorn on 127.0.0.1 and measures:
- API: the first list page on a cold server (the iteration index is built then), warm pages
  (sorted, filtered, searched, deep offsets), one sample's detail and one group;
- browser (headless Chromium, when installed): first paint = navigation start until the first 50
  rows are in the table, cold and warm server; a page turn; opening one sample until its tokens show.
Prints a Markdown table (medians of repeated requests).
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.viewer.app import create_app  # noqa: E402
from tasks.viewer.data import RunData  # noqa: E402
from tests.synthetic import write_synthetic_run  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(data: RunData):  # noqa: ANN202
    import uvicorn

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(data), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"


def _timed(client: httpx.Client, path: str, **params) -> float:  # noqa: ANN003
    started = time.perf_counter()
    response = client.get(path, params=params)
    response.raise_for_status()
    return (time.perf_counter() - started) * 1000


def _median(client: httpx.Client, requests: list[tuple[str, dict]]) -> float:
    return statistics.median(_timed(client, path, **params) for path, params in requests)


def _browser():  # noqa: ANN202
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,900"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)


_ROWS_SHOWN = "return document.querySelectorAll('tr.sample-row').length"


def _first_paint(driver, url: str) -> float:  # noqa: ANN001
    """ms from navigation start until the first page of rows is in the table."""
    driver.get(url)
    deadline = time.monotonic() + 120
    while driver.execute_script(_ROWS_SHOWN) < 50:
        if time.monotonic() > deadline:
            raise TimeoutError("the sample list did not render within 120 s")
        time.sleep(0.005)
    return driver.execute_script("return performance.now()")


def _browser_step(driver, action: str, done: str) -> float:  # noqa: ANN001
    started = time.perf_counter()
    driver.execute_script(action)
    while not driver.execute_script(done):
        time.sleep(0.002)
    return (time.perf_counter() - started) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="viewer-bench-"))
    try:
        started = time.perf_counter()
        write_synthetic_run(
            str(work / "runs"),
            "bench",
            local_dir=work,
            rows=args.rows,
            group_size=args.group_size,
            seed=0,
            top_k=args.top_k,
            texts=None,
            response_len=(32, 512),
            rows_per_shard=4096,
            row_group_size=256,
        )
        iteration = work / "runs" / "bench" / "iter-1"
        rollout_bytes, teacher_bytes = (
            sum(p.stat().st_size for p in (iteration / stage).glob("*.parquet")) for stage in ("rollout", "teacher")
        )
        print(
            f"wrote {args.rows} samples (K={args.top_k}, responses 32-512 tokens, rollout shards "
            f"{rollout_bytes / 2**20:.0f} MiB, teacher shards {teacher_bytes / 2**20:.0f} MiB, read joined) in "
            f"{time.perf_counter() - started:.0f} s",
            file=sys.stderr,
        )

        results: list[tuple[str, float]] = []
        server, thread, url = _serve(RunData(str(work / "runs"), "bench"))
        with httpx.Client(base_url=url, timeout=300) as client:
            results.append(
                (
                    "API: first list page, cold server (builds the index)",
                    _timed(client, "/api/iterations/1/samples", limit=50),
                )
            )
            rng = __import__("random").Random(0)
            pages = {
                "API: list page sorted by reward": [
                    (
                        "/api/iterations/1/samples",
                        {"sort": "reward", "order": "desc", "offset": rng.randrange(0, args.rows - 50)},
                    )
                    for _ in range(args.repeats)
                ],
                "API: list page sorted by divergence, masked only": [
                    ("/api/iterations/1/samples", {"sort": "divergence", "order": "desc", "mask": "masked"})
                    for _ in range(args.repeats)
                ],
                "API: list page, text search": [
                    ("/api/iterations/1/samples", {"q": "therefore box", "sort": "length"}) for _ in range(args.repeats)
                ],
                "API: one sample (tokens, top-K, teacher context)": [
                    (f"/api/iterations/1/samples/{rng.randrange(args.rows)}", {}) for _ in range(args.repeats)
                ],
                "API: one group": [
                    (f"/api/iterations/1/groups/{rng.randrange(args.rows // args.group_size)}", {})
                    for _ in range(args.repeats)
                ],
            }
            for name, requests in pages.items():
                results.append((name, _median(client, requests)))
        if shutil.which("chromium") and shutil.which("chromedriver"):
            server.should_exit = True
            thread.join()
            server, thread, url = _serve(RunData(str(work / "runs"), "bench"))  # cold again
            driver = _browser()
            try:
                results.append(("browser: first paint, cold server", _first_paint(driver, url + "/")))
                results.append(
                    (
                        "browser: first paint, warm server",
                        statistics.median(_first_paint(driver, url + "/") for _ in range(5)),
                    )
                )
                turns = [
                    _browser_step(
                        driver,
                        "window.__first = document.querySelector('tr.sample-row').dataset.sampleId;"
                        "document.getElementById('next').click();",
                        "return document.querySelector('tr.sample-row').dataset.sampleId !== window.__first",
                    )
                    for _ in range(args.repeats)
                ]
                results.append(("browser: page turn (next 50 rows)", statistics.median(turns)))
                opens = [
                    _browser_step(
                        driver,
                        f"document.body.dataset.ready = ''; document.querySelectorAll('tr.sample-row')[{j}].click();",
                        "return document.body.dataset.ready === 'sample'",
                    )
                    for j in range(args.repeats)
                ]
                results.append(("browser: open a sample until its tokens show", statistics.median(opens)))
            finally:
                driver.quit()
        server.should_exit = True
        thread.join()
        print("| measurement | ms |\n|---|---:|")
        for name, ms in results:
            print(f"| {name} | {ms:.0f} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
