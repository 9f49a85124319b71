"""The iteration flow with `rollout.engine: sglang` against the SGLang-API test server."""

from __future__ import annotations

from tests.integration.runs import assert_same_rollout, write_config
from tests.sglang_server.app import Fault, start_server


def test_sglang_rollout_matches_the_embedded_engine_and_survives_faults(tmp_path, prefect_server):
    from flows.run import sdpo_run
    from storage.layout import RunLayout
    from storage.manifest import read_latest
    from tasks.prepare_base import bootstrap_cache_dir
    from tasks.runtime import open_run

    embedded = write_config(tmp_path, "embedded")
    sdpo_run(str(embedded), ["iterations=1"])
    base_dir = bootstrap_cache_dir(open_run(str(tmp_path / "runs"), "embedded"))

    # one 503 and one dropped connection on /generate: retried, the iteration completes
    server = start_server(base_dir, faults=[Fault("503", times=1), Fault("drop", times=1)])
    try:
        remote = write_config(
            tmp_path,
            "remote",
            rollout={**yaml_rollout(), "engine": "sglang", "sglang": {"urls": [server.url], "health_timeout_s": 30}},
        )
        sdpo_run(str(remote), ["iterations=1"])
    finally:
        server.stop()

    assert read_latest(RunLayout(str(tmp_path / "runs"), "remote")) == 1
    assert_same_rollout(RunLayout(str(tmp_path / "runs"), "embedded"), RunLayout(str(tmp_path / "runs"), "remote"), 1)


def yaml_rollout() -> dict:
    from tests.integration.runs import TINY

    return dict(TINY["rollout"])
