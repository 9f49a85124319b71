"""Rollout through the real sglang-router in front of two SGLang-API servers, for two iterations."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.integration.runs import TINY, assert_same_rollout, write_config
from tests.sglang_server.app import start_server
from tests.sglang_server.router import start_router


def test_two_servers_behind_the_router_serve_the_run_and_follow_every_weight_update(tmp_path, prefect_server):
    from flows.run import sdpo_run
    from storage.checkpoints import resolve_checkpoint
    from storage.layout import RunLayout
    from storage.manifest import read_latest
    from tasks.engines.sglang.weights import checkpoint_weight_version
    from tasks.prepare_base import bootstrap_cache_dir
    from tasks.runtime import open_run

    embedded = write_config(tmp_path, "embedded")
    sdpo_run(str(embedded), ["iterations=2"])
    base_dir = bootstrap_cache_dir(open_run(str(tmp_path / "runs"), "embedded"))

    servers = [start_server(base_dir), start_server(base_dir)]  # SGLang's "default" version: loaded by the client
    try:
        with start_router([s.url for s in servers]) as router:
            remote = write_config(
                tmp_path,
                "remote",
                rollout={
                    **TINY["rollout"],
                    "engine": "sglang",
                    # the log-prob probe goes to each worker directly; off, every worker /generate is routed
                    "sglang": {
                        "urls": [s.url for s in servers],
                        "router_url": router.url,
                        "health_timeout_s": 30,
                        "check_logprobs": False,
                    },
                },
            )
            sdpo_run(str(remote), ["iterations=2"])
            workers = {w["url"]: w for w in router.workers()}
        reported = [httpx.get(f"{s.url}/get_model_info").json()["weight_version"] for s in servers]
    finally:
        for server in servers:
            server.stop()

    runs = str(tmp_path / "runs")
    layout = RunLayout(runs, "remote")
    assert read_latest(layout) == 2
    assert sorted(workers) == sorted(s.url for s in servers) and all(w["is_healthy"] for w in workers.values())

    rollout_rows = 0
    for n in (1, 2):
        rollout_rows += assert_same_rollout(RunLayout(runs, "embedded"), layout, n)
    generated = [s.faults.received["/generate"] for s in servers]
    assert all(count > 0 for count in generated), generated  # the router used both servers
    assert sum(generated) >= rollout_rows  # one routed request per sample, rollout and eval

    cache = tmp_path / "cache"

    def version(n: int) -> str:  # the client's version of the policy written by iteration n
        return checkpoint_weight_version(cache / resolve_checkpoint(layout, f"iter-{n}", "policy").sha256)

    updates = [s.faults.weight_updates for s in servers]
    assert updates[0] == updates[1]  # every update reached every server
    loaded = [v for _, v in updates[0]]
    # iteration n samples from policy n - 1 (and evaluation reloads the policies, then the teacher)
    assert loaded[0] == version(0), loaded
    assert loaded.index(version(0)) < loaded.index(version(1)) < loaded.index(version(2)), loaded
    assert {Path(path).parent for path, _ in updates[0]} == {cache.resolve()}  # the cached checkpoint folders
    assert reported == [loaded[-1], loaded[-1]]  # each server reports the weights it was given last


def test_the_client_waits_until_the_router_has_registered_its_workers(tmp_path):
    """The router answers /health before it routes anywhere: with the worker healthy to the client
    but not yet registered by the router, a first /generate would get the router's 503."""
    import threading

    from tasks.config import SGLangConfig
    from tasks.engines.sglang.client import SGLangEngine
    from tasks.engines.sglang.weights import checkpoint_weight_version
    from tests.integration.test_sglang_client import make_checkpoint
    from tests.sglang_server.app import Fault

    path = tmp_path / "policy"
    tokenizer = make_checkpoint(path, seed=0)
    with start_server(
        path, weight_version=checkpoint_weight_version(path), faults=[Fault("unhealthy", times=-1)]
    ) as server:
        with start_router([server.url], wait_for_workers=False) as router:
            # the router's first registration attempts fail; it retries later with backoff
            threading.Timer(2.0, server.faults.clear).start()
            config = SGLangConfig(urls=[server.url], router_url=router.url, health_timeout_s=60, retries=0)
            with SGLangEngine(config, str(path), router_url=router.url, check_logprobs=False) as engine:
                prompt = tokenizer.encode("12+3=")
                groups = engine.generate(
                    [prompt],
                    n=2,
                    temperature=1.0,
                    top_p=1.0,
                    max_new_tokens=3,
                    stop_token_ids=[],
                    top_k_logprobs=2,
                    seed=5,
                )
            assert [len(g) for g in groups] == [2]
            assert server.faults.received["/generate"] == 2  # both samples went through the router
