"""The rollout-engine interface shared by the embedded torch engine and the SGLang client.

Conventions every engine follows:

- Log-probs are of the model's raw next-token distribution: `log_softmax(logits)` at temperature 1,
  before top-p filtering. Temperature and top-p only shape how the token is *drawn*; the numbers
  recorded are what the trainer recomputes from its own forward pass (and what the teacher is
  compared against), so they are comparable with no correction for the sampling settings.
- When a stop token is drawn it is part of `response_ids` (and has its log-probs recorded), so the
  trainer sees and learns the decision to stop. `finish_reason` is "stop" then, and "length" when
  `max_new_tokens` ran out first; a stop token drawn as the last allowed token counts as "stop".
- `topk_ids` / `topk_logprobs` hold the K most likely ids of the raw distribution at each step,
  most likely first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

__all__ = ["FinishReason", "Generation", "RolloutEngine", "SamplingParams"]

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, kw_only=True)
class Generation:
    """One sampled response. All arrays have one row per response token (T = len(response_ids))."""

    response_ids: list[int]
    sampled_logprobs: np.ndarray  # [T] float32, log p(response_ids[t])
    topk_ids: np.ndarray  # [T, K] int32
    topk_logprobs: np.ndarray  # [T, K] float32
    finish_reason: FinishReason

    def __post_init__(self) -> None:
        num_tokens = len(self.response_ids)
        if self.sampled_logprobs.shape != (num_tokens,):
            raise ValueError(f"sampled_logprobs has shape {self.sampled_logprobs.shape}, expected ({num_tokens},)")
        if self.topk_ids.ndim != 2 or self.topk_ids.shape[0] != num_tokens:
            raise ValueError(f"topk_ids has shape {self.topk_ids.shape}, expected ({num_tokens}, K)")
        if self.topk_logprobs.shape != self.topk_ids.shape:
            raise ValueError(
                f"topk_logprobs has shape {self.topk_logprobs.shape}, topk_ids {self.topk_ids.shape}; they must match"
            )
        if self.finish_reason not in ("stop", "length"):
            raise ValueError(f"finish_reason must be 'stop' or 'length', got {self.finish_reason!r}")


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """The sampling settings of one `generate` call, checked once for every engine."""

    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    stop_token_ids: list[int]
    top_k_logprobs: int
    seed: int

    def __post_init__(self) -> None:
        if self.n < 1 or self.max_new_tokens < 1:
            raise ValueError(
                f"need n >= 1 and max_new_tokens >= 1, got n={self.n}, max_new_tokens={self.max_new_tokens}"
            )
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"need temperature >= 0 and 0 < top_p <= 1, got temperature={self.temperature}, top_p={self.top_p}"
            )
        if self.top_k_logprobs < 0:
            raise ValueError(f"top_k_logprobs must be >= 0, got {self.top_k_logprobs}")


class RolloutEngine(ABC):
    """Samples responses from the current policy weights.

    `generate` is the same for every engine: it checks its arguments and hands them to the
    engine's `_sample` as one `SamplingParams`; engines add only the checks their backend needs
    (the embedded engine: the model's vocabulary and context length).
    """

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        stop_token_ids: list[int],
        top_k_logprobs: int,
        seed: int,
        progress: bool = False,
    ) -> list[list[Generation]]:
        """Sample `n` responses per prompt (token ids, already chat-templated).

        Returns one list per prompt, in prompt order, each holding `n` generations. `temperature`
        0 means greedy decoding. For a fixed seed and weights the result is reproducible.
        `progress` shows a progress bar.
        """
        params = SamplingParams(
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            stop_token_ids=[int(t) for t in stop_token_ids],
            top_k_logprobs=top_k_logprobs,
            seed=seed,
        )
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty")
        return self._sample(prompts, params, progress=progress)

    @abstractmethod
    def _sample(self, prompts: list[list[int]], params: SamplingParams, *, progress: bool) -> list[list[Generation]]:
        """`generate` after its arguments are checked: prompts are non-empty, `params` valid."""

    @abstractmethod
    def load_weights(self, checkpoint_dir: str, *, weights: Mapping[str, Any] | None = None) -> None:
        """Replace the policy weights with those of an HF checkpoint folder (same architecture).

        `weights` are that folder's weights already in this process's memory (`tasks.kept_weights`):
        an engine holding its model in this process copies them instead of reading the folder's
        weights file; an engine in another process loads the folder."""

    @property
    @abstractmethod
    def weight_version(self) -> str:
        """An identifier of the weights now loaded (the checkpoint they came from)."""

    @abstractmethod
    def close(self) -> None:
        """Release the engine's resources; the engine is unusable afterwards."""
