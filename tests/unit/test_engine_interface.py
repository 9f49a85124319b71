"""The argument checks every rollout engine shares (`RolloutEngine.generate`)."""

from __future__ import annotations

from typing import Any

import pytest

from tasks.engines.base import Generation, RolloutEngine, SamplingParams
from tasks.engines.embedded import EmbeddedEngine
from tasks.engines.sglang.client import SGLangEngine

GOOD = dict(n=2, temperature=1.0, top_p=0.9, max_new_tokens=4, stop_token_ids=[7], top_k_logprobs=3, seed=5)


class Recorder(RolloutEngine):
    """An engine that records what `generate` hands to `_sample`."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[list[int]], SamplingParams, bool]] = []

    def _sample(self, prompts: list[list[int]], params: SamplingParams, *, progress: bool) -> list[list[Generation]]:
        self.calls.append((prompts, params, progress))
        return [[] for _ in prompts]

    def load_weights(self, checkpoint_dir: str, *, weights: Any = None) -> None:
        raise NotImplementedError

    @property
    def weight_version(self) -> str:
        return "recorder"

    def close(self) -> None:
        pass


def test_both_engines_share_the_checked_generate():
    assert issubclass(EmbeddedEngine, RolloutEngine) and issubclass(SGLangEngine, RolloutEngine)
    assert EmbeddedEngine.generate is RolloutEngine.generate
    assert SGLangEngine.generate is RolloutEngine.generate


def test_valid_arguments_reach_the_engine_as_sampling_params():
    engine = Recorder()
    engine.generate([[1, 2], [3]], **{**GOOD, "stop_token_ids": [7.0]}, progress=True)
    ((prompts, params, progress),) = engine.calls
    assert prompts == [[1, 2], [3]] and progress is True
    assert params == SamplingParams(**GOOD)
    assert all(type(t) is int for t in params.stop_token_ids)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"n": 0}, "n >= 1"),
        ({"max_new_tokens": 0}, "max_new_tokens >= 1"),
        ({"seed": -1}, "seed must be >= 0"),
        ({"temperature": -0.1}, "temperature >= 0"),
        ({"top_p": 0.0}, "0 < top_p <= 1"),
        ({"top_p": 1.5}, "0 < top_p <= 1"),
        ({"top_k_logprobs": -1}, "top_k_logprobs must be >= 0"),
    ],
)
def test_invalid_arguments_are_rejected_before_sampling(change, message):
    engine = Recorder()
    with pytest.raises(ValueError, match=message):
        engine.generate([[1]], **{**GOOD, **change})
    assert engine.calls == []


def test_an_empty_prompt_is_rejected_by_index():
    engine = Recorder()
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []], **GOOD)
    assert engine.calls == []
