"""The hand-over slots of pipelined commits (tasks/handover.py): what the next stages wait for."""

from __future__ import annotations

import threading

import pytest

from tasks import handover

URL = "file:///runs/r"


@pytest.fixture(autouse=True)
def _no_slots():
    yield
    for n in range(10):
        handover.close(URL, n)


def test_a_writer_that_finishes_before_the_offer_still_hands_its_digest_over():
    slot = handover.open_slot(URL, 1)
    handover.digest_taken(URL, 1, "policy", "ab" * 32)  # the writer thread was faster than the offer
    handover.offer(URL, 1, {"policy": {"w": 1}})
    assert slot.digest("policy").result(timeout=1) == "ab" * 32
    assert slot.weights("policy") == {"w": 1}


def test_the_next_stage_waits_for_the_offer():
    slot = handover.open_slot(URL, 2)
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(slot.weights("teacher")))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got
    handover.offer(URL, 2, {"policy": {}, "teacher": {"t": 2}})
    waiter.join(5)
    assert got == [{"t": 2}]


def test_an_iteration_committed_without_an_offer_sends_its_readers_to_the_store():
    slot = handover.open_slot(URL, 3)
    handover.committed(URL, 3)  # a train stage adopted from the store hands nothing over
    assert slot.weights("policy") is None


def test_a_failure_reaches_every_waiter_with_its_cause():
    slot = handover.open_slot(URL, 4)
    digest = slot.digest("policy")
    slot.fail(OSError("the disk is full"))
    with pytest.raises(OSError, match="the disk is full"):
        slot.weights("policy")
    with pytest.raises(OSError, match="the disk is full"):
        digest.result(timeout=1)
    with pytest.raises(OSError, match="the disk is full"):
        slot.done.result(timeout=1)


def test_nothing_is_offered_without_a_slot_and_a_slot_opens_once():
    assert handover.offer(URL, 5, {"policy": {}}) is None
    handover.open_slot(URL, 6)
    with pytest.raises(RuntimeError, match="already has a hand-over slot"):
        handover.open_slot(URL, 6)
    with pytest.raises(KeyError, match="not a 'teacher' checkpoint"):
        handover.offer(URL, 6, {"policy": {}}).weights("teacher")


@pytest.mark.parametrize(
    ("overrides", "overlapped"),
    [
        ([], True),
        (
            ["rollout.engine=sglang", "rollout.sglang.urls=[http://127.0.0.1:30000]"],
            False,
        ),  # its servers load folders: handed-over tensors cannot reach them
        (["pipeline.max_staleness=1"], False),
        (["launch.overlap_commits=false"], False),
    ],
)
def test_commits_overlap_only_where_every_stage_can_take_weights_from_memory(overrides, overlapped):
    from flows.overlap import overlap_enabled
    from tasks.config import load_config

    assert overlap_enabled(load_config(None, overrides)) is overlapped


def test_an_sglang_engine_is_never_handed_tensors_it_would_ignore(tmp_path):
    from tasks.config import load_config
    from tasks.rollout import get_engine

    cfg = load_config(None, ["rollout.engine=sglang", "rollout.sglang.urls=[http://127.0.0.1:30000]"])
    with pytest.raises(ValueError, match="rollout.engine='sglang' loads checkpoints from folders"):
        get_engine(cfg.rollout, tmp_path, cache_key="k", weights={"w": 1})
