"""Plain records passed between rollout, verification and teacher-context building.

These are the seams between stages: a rollout produces `SampleRecord`s, a verifier returns a
`Verdict` per sample, and a feedback policy turns a group of records into `TeacherContext`s. They
hold plain Python values only (no tensors, no tokenizer), so they can be built and checked on a CPU
worker and serialised by `storage/` without knowing about the algorithm.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypedDict, get_args


class Message(TypedDict):
    """One chat message. Only text content is supported."""

    role: str
    content: str


TeacherSource = Literal["solution", "feedback", "solution+feedback", "prompt", "none"]
"""What privileged information the teacher sees for one sample.

- "solution": a successful attempt (a peer's, or the sample's own where the policy allows it).
- "feedback": the environment's feedback on this sample.
- "solution+feedback": both.
- "prompt": a privileged teacher prompt taken from the data set (OPSD).
- "none": nothing beyond the student prompt (plain OPD, or an SDPO sample that is masked out).
"""

TEACHER_SOURCES: tuple[str, ...] = get_args(TeacherSource)


def validate_messages(messages: Sequence[object], *, what: str) -> None:
    """Raise if `messages` is not a non-empty sequence of text chat messages.

    Extra keys (for example "name") are allowed and carried along; `role` and `content` must be
    strings, because privileged text is spliced into `content` and multimodal content lists are not
    supported.
    """
    if len(messages) == 0:
        raise ValueError(f"{what}: the message list is empty")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TypeError(f"{what}: message {i} is a {type(message).__name__}, expected a dict")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise TypeError(
                f"{what}: message {i} needs string 'role' and 'content' "
                f"(text only), got role={role!r}, content of type {type(content).__name__}"
            )


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """What a verifier says about one response.

    `truncated` is the verifier's own view that the response was cut off; the rollout's
    `finish_reason == "length"` is the source of truth, and `FeedbackPolicy.record_feedback` rejects a
    truncated verdict for a response the engine did not cut off.
    """

    reward: float
    feedback: str | None = None
    format_error: bool = False
    truncated: bool = False

    def __post_init__(self) -> None:
        if not math.isfinite(self.reward):
            raise ValueError(f"Verdict.reward must be finite, got {self.reward!r}")


@dataclass(frozen=True, kw_only=True)
class SampleRecord:
    """One sampled response with its verdict, as the feedback policy sees it.

    `prompt_messages` is the student's chat prompt (before the chat template). `feedback` is the
    verifier's text (None when there is none). `teacher_prompt` is the OPSD privileged prompt from a
    data column, None for other algorithms. `finish_reason` is the engine's ("stop", "length", ...).
    """

    sample_id: int
    group_id: int
    prompt_messages: tuple[dict[str, Any], ...]
    response_text: str
    reward: float
    feedback: str | None
    finish_reason: str
    format_error: bool = False
    teacher_prompt: str | None = None

    def __post_init__(self) -> None:
        # Accept a list for convenience but store a tuple so the record stays hashable-ish and frozen.
        object.__setattr__(self, "prompt_messages", tuple(self.prompt_messages))
        validate_messages(self.prompt_messages, what=f"SampleRecord(sample_id={self.sample_id})")
        if not math.isfinite(self.reward):
            raise ValueError(f"SampleRecord(sample_id={self.sample_id}).reward must be finite, got {self.reward!r}")

    @property
    def truncated(self) -> bool:
        """The engine stopped this response at the length limit."""
        return self.finish_reason == "length"


@dataclass(frozen=True, kw_only=True)
class TeacherContext:
    """The teacher's view of one sample.

    `messages` is the full message list the teacher sees: the student's messages with any privileged
    text placed inside the last user message (never after an assistant header). The caller renders
    it with the same chat template and template kwargs as the student prompt, then appends the
    student's response token ids unchanged. `mask` False means the sample contributes no
    self-distillation loss.
    """

    sample_id: int
    messages: tuple[dict[str, Any], ...]
    mask: bool
    source: TeacherSource

    def __post_init__(self) -> None:
        object.__setattr__(self, "messages", tuple(self.messages))
        validate_messages(self.messages, what=f"TeacherContext(sample_id={self.sample_id})")
        if self.source not in TEACHER_SOURCES:
            raise ValueError(f"TeacherContext.source must be one of {TEACHER_SOURCES}, got {self.source!r}")
        if not self.mask and self.source != "none":
            raise ValueError(
                f"TeacherContext(sample_id={self.sample_id}) is masked out but has source={self.source!r}; "
                "a masked sample must have source='none'"
            )
