"""The SGLang rollout client against the SGLang-API test server (backed by the embedded engine).

The oracle is the embedded engine called directly: for the same seed and weights the client must
return the same rows (tokens, finish reasons, dtypes, shapes; log-probs within 1e-5).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch

from tasks.config import SGLangConfig
from tasks.data.bootstrap_model import build_model, build_tokenizer, prompt_ids
from tasks.engines.base import RolloutEngine
from tasks.engines.embedded import EmbeddedEngine
from tasks.engines.sglang.client import SGLangEngine
from tasks.engines.sglang.errors import (
    SGLangLogprobError,
    SGLangRequestError,
    SGLangUnavailableError,
    SGLangWeightVersionError,
)
from tasks.engines.sglang.schema import sample_seed, split_sample_seed
from tasks.engines.sglang.weights import checkpoint_weight_version
from tests.sglang_server.app import Fault, start_server

MESSAGES = [
    [{"role": "user", "content": "3+4="}],
    [{"role": "user", "content": "12+345="}],
    [{"role": "system", "content": "Add."}, {"role": "user", "content": "7+8="}],
]


def make_checkpoint(path, *, seed):
    tokenizer = build_tokenizer(path)
    model = build_model(
        tokenizer, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, max_positions=64, seed=seed
    )
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # peaked, tie-free distributions
    model.save_pretrained(path)
    return tokenizer


@pytest.fixture(scope="module")
def ckpt_a(tmp_path_factory):
    path = tmp_path_factory.mktemp("policy-a")
    return path, make_checkpoint(path, seed=0)


@pytest.fixture(scope="module")
def ckpt_b(tmp_path_factory):
    path = tmp_path_factory.mktemp("policy-b")
    make_checkpoint(path, seed=1)
    return path


@pytest.fixture(scope="module")
def prompts(ckpt_a):
    _, tokenizer = ckpt_a
    return [prompt_ids(tokenizer, m) for m in MESSAGES]


@pytest.fixture(scope="module")
def eos(ckpt_a):
    return int(ckpt_a[1].eos_token_id)


@pytest.fixture(scope="module")
def reference(ckpt_a):
    engine = EmbeddedEngine(str(ckpt_a[0]), max_batch_size=8)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def server(ckpt_a):
    """Shared server holding checkpoint A under the client's version for it (no reload per engine)."""
    path, _ = ckpt_a
    with start_server(path, weight_version=checkpoint_weight_version(path)) as running:
        yield running


@pytest.fixture(autouse=True)
def clean_faults(server):
    server.faults.clear()
    server.faults.reset_stats()
    yield
    server.faults.clear()


@pytest.fixture
def make_engine(ckpt_a, server):
    engines = []

    def make(urls=None, checkpoint=None, *, timeout=10.0, health=5.0, retries=3, **kwargs):
        config = SGLangConfig(
            urls=urls or [server.url],
            request_timeout_s=timeout,
            health_timeout_s=health,
            retries=retries,
            max_concurrency=8,
        )
        engine = SGLangEngine(config, str(checkpoint or ckpt_a[0]), backoff_s=0.01, max_backoff_s=0.05, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def sample(engine, prompts, **overrides):
    kwargs = dict(n=3, temperature=1.3, top_p=0.9, max_new_tokens=6, stop_token_ids=[], top_k_logprobs=5, seed=11)
    kwargs.update(overrides)
    return engine.generate(prompts, **kwargs)


def assert_same_rows(actual, expected):
    assert len(actual) == len(expected)
    for got_group, want_group in zip(actual, expected, strict=True):
        assert len(got_group) == len(want_group)
        for got, want in zip(got_group, want_group, strict=True):
            assert got.response_ids == want.response_ids
            assert got.finish_reason == want.finish_reason
            for name in ("sampled_logprobs", "topk_ids", "topk_logprobs"):
                a, b = getattr(got, name), getattr(want, name)
                assert a.dtype == b.dtype and a.shape == b.shape, name
            np.testing.assert_array_equal(got.topk_ids, want.topk_ids)
            np.testing.assert_allclose(got.sampled_logprobs, want.sampled_logprobs, atol=1e-5)
            np.testing.assert_allclose(got.topk_logprobs, want.topk_logprobs, atol=1e-5)


def generate_calls(server):
    return server.faults.received["/generate"]


def injected(server, kind):
    return sum(1 for k, _ in server.faults.injected if k == kind)


# --------------------------------------------------------------------------- same rows as embedded


def test_engine_satisfies_the_interface(make_engine):
    assert isinstance(make_engine(), RolloutEngine)


def test_sampled_rows_equal_the_embedded_engine_for_the_same_seed(make_engine, reference, prompts, eos):
    engine = make_engine()
    got = sample(engine, prompts, stop_token_ids=[eos])
    assert_same_rows(got, sample(reference, prompts, stop_token_ids=[eos]))
    assert {g.sampled_logprobs.dtype for grp in got for g in grp} == {np.dtype(np.float32)}
    assert_same_rows(sample(engine, prompts, stop_token_ids=[eos]), got)  # reproducible
    other = sample(engine, prompts, stop_token_ids=[eos], seed=12)
    assert [[g.response_ids for g in grp] for grp in other] != [[g.response_ids for g in grp] for grp in got]


def test_greedy_rows_and_stop_tokens_equal_the_embedded_engine(make_engine, reference, prompts, eos):
    engine = make_engine()
    greedy = dict(n=1, temperature=0.0, max_new_tokens=8)
    plain = sample(reference, prompts, stop_token_ids=[eos], **greedy)
    stop = plain[1][0].response_ids[2]
    expected = sample(reference, prompts, stop_token_ids=[eos, stop], **greedy)
    assert expected[1][0].finish_reason == "stop" and expected[1][0].response_ids[-1] == stop
    assert_same_rows(sample(engine, prompts, stop_token_ids=[eos, stop], **greedy), expected)


def test_stop_token_drawn_as_the_last_allowed_token_is_reported_as_stop(make_engine, reference, prompts, server):
    vocab = reference.model.config.vocab_size
    everything = dict(max_new_tokens=1, stop_token_ids=list(range(vocab)))
    answer = httpx.post(
        f"{server.url}/generate",
        json={
            "input_ids": prompts[0],
            "sampling_params": {"max_new_tokens": 1, "stop_token_ids": list(range(vocab))},
        },
    ).json()
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 1}  # SGLang checks length first
    got = sample(make_engine(), prompts, **everything)
    assert all(g.finish_reason == "stop" for grp in got for g in grp)
    assert_same_rows(got, sample(reference, prompts, **everything))


def test_zero_top_k_gives_empty_topk_arrays(make_engine, reference, prompts, eos):
    got = sample(make_engine(), prompts, top_k_logprobs=0, stop_token_ids=[eos])
    assert all(g.topk_ids.shape == (len(g.response_ids), 0) for grp in got for g in grp)
    assert_same_rows(got, sample(reference, prompts, top_k_logprobs=0, stop_token_ids=[eos]))


def test_requests_are_spread_over_several_servers(make_engine, reference, prompts, server, ckpt_a, eos):
    path, _ = ckpt_a
    with start_server(path, weight_version=checkpoint_weight_version(path)) as second:
        engine = make_engine([server.url, second.url])
        got = sample(engine, prompts, stop_token_ids=[eos], temperature=1.0, top_p=1.0)
        assert generate_calls(server) > 0 and second.faults.received["/generate"] > 0
        assert_same_rows(got, sample(reference, prompts, stop_token_ids=[eos], temperature=1.0, top_p=1.0))


def test_a_router_url_takes_the_generation_traffic(make_engine, reference, prompts, server, ckpt_a, eos):
    path, _ = ckpt_a
    greedy = dict(n=2, temperature=0.0, stop_token_ids=[eos])
    with start_server(path, weight_version=checkpoint_weight_version(path)) as router:
        engine = make_engine([server.url], router_url=router.url)
        got = sample(engine, prompts, **greedy)
        # one request per sample: the router's /generate takes a single sampling_params object
        assert router.faults.received["/generate"] == len(prompts) * 2 and generate_calls(server) == 0
        assert server.faults.received["/get_model_info"] > 0  # versions are checked on the workers
        assert_same_rows(got, sample(reference, prompts, **greedy))


def test_generation_works_from_a_running_event_loop_and_from_threads(make_engine, reference, prompts, eos):
    engine = make_engine()
    expected = sample(reference, prompts, stop_token_ids=[eos])

    async def inside_a_loop():
        return sample(engine, prompts, stop_token_ids=[eos])  # a sync call while this loop runs

    assert_same_rows(asyncio.run(inside_a_loop()), expected)
    with ThreadPoolExecutor(2) as pool:
        for result in pool.map(lambda _: sample(engine, prompts, stop_token_ids=[eos]), range(2)):
            assert_same_rows(result, expected)


def test_unrequested_model_eos_stops_are_reported_as_stop(tmp_path, ckpt_a, make_engine, reference, prompts, caplog):
    path, _ = ckpt_a
    greedy = sample(reference, prompts[:1], n=1, temperature=0.0, max_new_tokens=8)[0][0].response_ids
    cut = next(k for k in range(1, len(greedy)) if greedy[k] not in greedy[:k])
    copy = tmp_path / "extra-eos"
    shutil.copytree(path, copy)
    config_file = copy / "generation_config.json"
    generation = json.loads(config_file.read_text())
    generation["eos_token_id"] = [generation["eos_token_id"], greedy[cut]]
    config_file.write_text(json.dumps(generation))
    with start_server(copy) as other:
        engine = make_engine([other.url], checkpoint=copy)
        with caplog.at_level(logging.WARNING, logger="tasks.engines.sglang"):
            got = sample(engine, prompts[:1], n=1, temperature=0.0, max_new_tokens=8)[0][0]
    assert got.response_ids == greedy[: cut + 1] and got.finish_reason == "stop"
    assert "model's own EOS" in caplog.text


# --------------------------------------------------------------------------- faults


def test_transient_503s_are_retried(make_engine, reference, prompts, server, eos):
    engine = make_engine()
    server.faults.add(Fault("503", times=2))
    got = sample(engine, prompts, stop_token_ids=[eos])
    assert injected(server, "503") == 2
    assert_same_rows(got, sample(reference, prompts, stop_token_ids=[eos]))


def test_a_dropped_connection_is_retried(make_engine, reference, prompts, server, eos):
    engine = make_engine()
    server.faults.add(Fault("drop", times=1))
    got = sample(engine, prompts, stop_token_ids=[eos])
    assert injected(server, "drop") == 1
    assert_same_rows(got, sample(reference, prompts, stop_token_ids=[eos]))


def test_a_slow_answer_times_out_and_is_retried(make_engine, reference, prompts, server, eos):
    engine = make_engine(timeout=1.0)
    server.faults.add(Fault("slow", times=1, delay_s=2.5))
    got = sample(engine, prompts, stop_token_ids=[eos], temperature=0.0)
    assert injected(server, "slow") == 1
    assert_same_rows(got, sample(reference, prompts, stop_token_ids=[eos], temperature=0.0))


def test_failures_beyond_the_configured_retries_raise(make_engine, prompts, server):
    engine = make_engine(retries=2)
    server.faults.add(Fault("503", times=-1))
    with pytest.raises(SGLangUnavailableError, match=r"failed 3 times .*HTTP 503"):
        sample(engine, prompts[:1], temperature=0.0)
    assert generate_calls(server) == 3


def test_a_server_that_never_becomes_healthy_fails_within_the_health_timeout(make_engine, server):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once the socket closes
    server.faults.add(Fault("unhealthy", times=-1))
    started = time.monotonic()
    with pytest.raises(SGLangUnavailableError, match="not healthy after 1s") as info:
        make_engine([server.url, dead], health=1.0)
    assert time.monotonic() - started < 3.0
    assert f"{server.url} (HTTP 503)" in str(info.value) and f"{dead} (Connect" in str(info.value)


def test_a_server_that_becomes_healthy_is_waited_for(make_engine, server):
    server.faults.add(Fault("unhealthy", times=3))
    make_engine(health=5.0)
    assert injected(server, "unhealthy") == 3


def test_a_4xx_answer_carries_the_server_message_and_is_not_retried(make_engine, server):
    engine = make_engine()
    with pytest.raises(SGLangRequestError, match="context length of 64") as info:
        engine.generate(
            [[5] * 60], n=1, temperature=0.0, top_p=1.0, max_new_tokens=8, stop_token_ids=[], top_k_logprobs=2, seed=0
        )
    assert info.value.status == 400
    assert generate_calls(server) == 1


def test_a_server_reporting_other_weights_is_never_used(make_engine, prompts, server):
    engine = make_engine()
    server.faults.add(Fault("wrong_version", times=-1, path="/get_model_info", version="iter-0-weights"))
    with pytest.raises(SGLangWeightVersionError, match=f"{server.url} has 'iter-0-weights'"):
        sample(engine, prompts, temperature=0.0)
    assert generate_calls(server) == 0


def test_an_answer_from_other_weights_is_caught(make_engine, prompts, server):
    engine = make_engine()
    server.faults.add(Fault("wrong_version", times=-1, path="/generate", version="iter-0-weights"))
    with pytest.raises(SGLangWeightVersionError, match="answered with weights 'iter-0-weights'"):
        sample(engine, prompts, temperature=0.0)


def test_processed_logprobs_are_detected(make_engine, prompts, server):
    engine = make_engine()
    server.faults.add(Fault("tempered_logprobs", times=-1))
    with pytest.raises(SGLangLogprobError, match="SGLANG_RETURN_ORIGINAL_LOGPROB=1"):
        sample(engine, prompts, temperature=1.0)


# --------------------------------------------------------------------------- weights


def test_load_weights_switches_the_servers_weights(ckpt_a, ckpt_b, make_engine, prompts, eos):
    path_a, _ = ckpt_a
    greedy = dict(n=1, temperature=0.0, max_new_tokens=8, stop_token_ids=[eos])
    with start_server(path_a) as fresh:  # launched with SGLang's default version, not the client's
        engine = make_engine([fresh.url], checkpoint=path_a)
        info = httpx.get(f"{fresh.url}/get_model_info").json()
        assert info["weight_version"] == engine.weight_version == checkpoint_weight_version(path_a)
        before = sample(engine, prompts, **greedy)

        fresh.faults.add(Fault("unhealthy", times=2))  # e.g. a restarted server: waited for, then loaded
        engine.load_weights(str(ckpt_b))
        info = httpx.get(f"{fresh.url}/get_model_info").json()
        assert engine.weight_version == info["weight_version"] == checkpoint_weight_version(ckpt_b)
        assert info["model_path"] == str(ckpt_b.resolve())
        after = sample(engine, prompts, **greedy)
        assert [g[0].response_ids for g in before] != [g[0].response_ids for g in after]
        reference_b = EmbeddedEngine(str(ckpt_b), max_batch_size=8)
        assert_same_rows(after, sample(reference_b, prompts, **greedy))
        reference_b.close()
        assert fresh.faults.received["/flush_cache"] >= 2 and fresh.faults.received["/update_weights_from_disk"] == 2


def test_a_server_already_holding_the_weights_is_not_reloaded(make_engine, server):
    make_engine()
    assert server.faults.received["/update_weights_from_disk"] == 0


def test_weight_versions_identify_checkpoints(tmp_path, ckpt_a, ckpt_b):
    assert checkpoint_weight_version(ckpt_a[0]) == checkpoint_weight_version(ckpt_a[0])
    assert checkpoint_weight_version(ckpt_a[0]) != checkpoint_weight_version(ckpt_b)
    digest = "ab" * 32
    cached = tmp_path / digest
    shutil.copytree(ckpt_b, cached)
    assert checkpoint_weight_version(cached) == f"ckpt-{digest[:16]}"
    with pytest.raises(FileNotFoundError, match="config.json"):
        checkpoint_weight_version(tmp_path)


# --------------------------------------------------------------------------- seeds, lifecycle


def test_sample_seeds_pack_and_unpack():
    assert split_sample_seed(sample_seed(123, 45, 6)) == (123, 45, 6)
    assert split_sample_seed(sample_seed(2**30 + 5, 0, 0)) == (5, 0, 0)
    assert sample_seed(2**40, 2**20 - 1, 2**12 - 1) < 2**62
    with pytest.raises(ValueError, match="sample_index"):
        sample_seed(0, 0, 2**12)
    with pytest.raises(ValueError, match="prompt_index"):
        sample_seed(0, 2**20, 0)


def test_a_closed_engine_refuses_work(make_engine, prompts):
    engine = make_engine()
    engine.close()
    engine.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        sample(engine, prompts)


# --------------------------------------------------------------------------- the test server's API


def test_server_answers_in_sglang_shapes(server, prompts, ckpt_a):
    single = httpx.post(
        f"{server.url}/generate",
        json={
            "text": "3+4=",
            "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            "return_logprob": True,
            "top_logprobs_num": 2,
            "logprob_start_len": 0,
        },
    ).json()
    meta = single["meta_info"]
    assert set(single) == {"text", "output_ids", "meta_info"}
    assert {"id", "finish_reason", "prompt_tokens", "weight_version", "completion_tokens", "cached_tokens"} <= set(meta)
    assert meta["finish_reason"] == {"type": "length", "length": 3} and meta["completion_tokens"] == 3
    assert [e[1] for e in meta["output_token_logprobs"]] == single["output_ids"]
    assert all(len(e) == 3 and e[2] is None for e in meta["output_token_logprobs"])
    assert all(len(row) == 2 and len(row[0]) == 3 for row in meta["output_top_logprobs"])
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"] and meta["input_token_logprobs"][0][0] is None
    assert meta["input_top_logprobs"][0] is None

    batch = httpx.post(
        f"{server.url}/generate",
        json={
            "input_ids": prompts[:2],
            "sampling_params": [{"max_new_tokens": 2, "temperature": 0, "n": 2}] * 2,
        },
    ).json()
    assert isinstance(batch, list) and len(batch) == 4  # n=2 repeats the input list
    assert batch[0]["output_ids"] == batch[2]["output_ids"]
    assert "output_token_logprobs" not in batch[0]["meta_info"]

    bad = httpx.post(f"{server.url}/generate", json={"input_ids": prompts[0], "sampling_params": {"top_p": 2}})
    assert bad.status_code == 400 and "top_p" in bad.json()["error"]["message"]
    missing = httpx.post(f"{server.url}/update_weights_from_disk", json={"model_path": "/nonexistent"})
    assert missing.status_code == 400 and missing.json()["success"] is False
    assert httpx.get(f"{server.url}/health_generate").status_code == 200
    assert httpx.post(f"{server.url}/flush_cache").status_code == 200
