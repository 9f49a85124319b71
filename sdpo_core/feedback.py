"""Feedback policies: how a group of verified samples becomes teacher contexts and masks.

One interface, `FeedbackPolicy`, with two hooks:
- `record_feedback(sample, verdict)`: fold a verifier's verdict into the sample's record.
- `prepare_group(group)`: decide, for every sample of one prompt group, what the teacher sees and
  whether the sample is trained on (`TeacherContext.mask`).

The variant is chosen once, by name or dotted path, through `load_feedback`.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from sdpo_core.records import SampleRecord, TeacherContext, TeacherSource, Verdict
from sdpo_core.teacher_context import (
    FEEDBACK_PLACEHOLDERS,
    FEEDBACK_TEMPLATE,
    REPROMPT_PLACEHOLDERS,
    REPROMPT_TEMPLATE,
    SOLUTION_PLACEHOLDERS,
    SOLUTION_TEMPLATE,
    build_relax_teacher_messages,
    build_teacher_messages,
    check_template,
    fit_demonstration,
    replace_last_user_content,
    select_demonstrations,
    select_feedback,
    strip_thinking,
)

logger = logging.getLogger(__name__)


def _usable(policy: Any, group: Sequence[SampleRecord]) -> list[bool]:
    """Whether each success would show its peers anything (failures: True, they are never chosen)."""
    return [s.reward < policy.success_threshold or bool(policy.demonstration_text(s).strip()) for s in group]


def _check_group(group: Sequence[SampleRecord]) -> None:
    if len(group) == 0:
        raise ValueError("prepare_group needs a non-empty group")
    group_ids = sorted({s.group_id for s in group})
    if len(group_ids) != 1:
        raise ValueError(f"all samples of a group must share group_id; got group_ids {group_ids}")
    sample_ids = [s.sample_id for s in group]
    if len(set(sample_ids)) != len(sample_ids):
        duplicates = sorted({i for i in sample_ids if sample_ids.count(i) > 1})
        raise ValueError(f"duplicate sample_id in group {group_ids[0]}: {duplicates}")


def _check_threshold(value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"success_threshold must be finite, got {value!r}")


def _check_demo_policy(max_demo_chars: int | None, demo_overflow: str) -> None:
    if max_demo_chars is not None and max_demo_chars < 1:
        raise ValueError(f"max_demo_chars must be >= 1 or None, got {max_demo_chars}")
    if demo_overflow not in ("truncate", "error"):
        raise ValueError(f"demo_overflow must be 'truncate' or 'error', got {demo_overflow!r}")


class FeedbackPolicy(ABC):
    """Turns verified samples into teacher contexts; one subclass per algorithm."""

    def record_feedback(self, sample: SampleRecord, verdict: Verdict) -> SampleRecord:
        """A copy of `sample` carrying the verdict's reward, feedback text and format flag.

        Empty or whitespace-only feedback is stored as None. A verdict that says "truncated" for a
        response the engine did not stop at the length limit is an upstream bug and raises.
        """
        if verdict.truncated and not sample.truncated:
            raise ValueError(
                f"sample {sample.sample_id}: the verdict says truncated but finish_reason={sample.finish_reason!r}"
            )
        feedback = verdict.feedback if verdict.feedback is not None and verdict.feedback.strip() else None
        return dataclasses.replace(
            sample, reward=float(verdict.reward), feedback=feedback, format_error=verdict.format_error
        )

    def demonstrations(self, group: Sequence[SampleRecord]) -> list[int | None]:
        """Index in `group` of the sample each sample's teacher is shown as a demonstration, or None.

        Policies without demonstrations (OPD, OPSD) return None for every sample.
        """
        _check_group(group)
        return [None] * len(group)

    @abstractmethod
    def prepare_group(self, group: Sequence[SampleRecord]) -> list[TeacherContext]:
        """One context per sample, in the order of `group`; all samples share one group_id."""


@dataclass(frozen=True, kw_only=True)
class OPDFeedback(FeedbackPolicy):
    """Plain on-policy distillation: the teacher sees the student prompt; every sample is trained."""

    def prepare_group(self, group: Sequence[SampleRecord]) -> list[TeacherContext]:
        _check_group(group)
        return [
            TeacherContext(sample_id=s.sample_id, messages=copy.deepcopy(s.prompt_messages), mask=True, source="none")
            for s in group
        ]


@dataclass(frozen=True, kw_only=True)
class OPSDFeedback(FeedbackPolicy):
    """On-policy self-distillation with a privileged teacher prompt from the data set.

    The record's `teacher_prompt` replaces the content of the last user message; system messages and
    earlier turns are kept. Every sample is trained.
    """

    def prepare_group(self, group: Sequence[SampleRecord]) -> list[TeacherContext]:
        _check_group(group)
        contexts = []
        for s in group:
            if s.teacher_prompt is None or not s.teacher_prompt.strip():
                raise ValueError(
                    f"sample {s.sample_id} (group {s.group_id}) has no teacher_prompt; OPSD needs the "
                    "privileged prompt column filled for every row"
                )
            messages = replace_last_user_content(s.prompt_messages, s.teacher_prompt)
            contexts.append(TeacherContext(sample_id=s.sample_id, messages=messages, mask=True, source="prompt"))
        return contexts


def _source(*, solution: str | None, feedback: str | None) -> TeacherSource:
    if solution is not None and feedback is not None:
        return "solution+feedback"
    if solution is not None:
        return "solution"
    if feedback is not None:
        return "feedback"
    return "none"


@dataclass(frozen=True, kw_only=True)
class SDPOFeedback(FeedbackPolicy):
    """The paper's policy: a peer's success and/or environment feedback, templated into the prompt.

    Each sample gets the first success of its group (excluding itself by default), with reasoning
    stripped and its length bounded, and the environment feedback under the two feedback flags. A
    sample with neither is masked out: with the defaults a lone success teaches nothing, and a group
    where everything fails without feedback gives no signal at all.
    """

    success_threshold: float = 0.5
    dont_reprompt_on_self_success: bool = True
    remove_thinking_from_demonstration: bool = True
    include_environment_feedback: bool = True
    environment_feedback_only_without_solution: bool = True
    max_demo_chars: int | None = None
    demo_overflow: Literal["truncate", "error"] = "truncate"
    solution_template: str = SOLUTION_TEMPLATE
    feedback_template: str = FEEDBACK_TEMPLATE
    reprompt_template: str = REPROMPT_TEMPLATE

    def __post_init__(self) -> None:
        _check_threshold(self.success_threshold)
        _check_demo_policy(self.max_demo_chars, self.demo_overflow)
        check_template(self.solution_template, required=SOLUTION_PLACEHOLDERS, what="solution_template")
        check_template(self.feedback_template, required=FEEDBACK_PLACEHOLDERS, what="feedback_template")
        check_template(self.reprompt_template, required=REPROMPT_PLACEHOLDERS, what="reprompt_template")

    def demonstration_text(self, sample: SampleRecord) -> str:
        """The text of `sample` as a demonstration for its peers."""
        return _demonstration_text(
            sample,
            remove_thinking=self.remove_thinking_from_demonstration,
            max_chars=self.max_demo_chars,
            overflow=self.demo_overflow,
        )

    def demonstrations(self, group: Sequence[SampleRecord]) -> list[int | None]:
        """The first success of the group with a non-empty demonstration, excluding the sample
        itself by default."""
        _check_group(group)
        return select_demonstrations(
            [s.reward for s in group],
            [s.group_id for s in group],
            success_threshold=self.success_threshold,
            exclude_self=self.dont_reprompt_on_self_success,
            usable=_usable(self, group),
        )

    def prepare_group(self, group: Sequence[SampleRecord]) -> list[TeacherContext]:
        demos = self.demonstrations(group)
        contexts = []
        for sample, demo in zip(group, demos, strict=True):
            solution = None if demo is None else self.demonstration_text(group[demo])
            feedback = select_feedback(
                sample.feedback,
                has_solution=solution is not None,
                include_environment_feedback=self.include_environment_feedback,
                environment_feedback_only_without_solution=self.environment_feedback_only_without_solution,
            )
            messages = build_teacher_messages(
                sample.prompt_messages,
                solution=solution,
                feedback=feedback,
                solution_template=self.solution_template,
                feedback_template=self.feedback_template,
                reprompt_template=self.reprompt_template,
            )
            source = _source(solution=solution, feedback=feedback)
            contexts.append(
                TeacherContext(sample_id=sample.sample_id, messages=messages, mask=source != "none", source=source)
            )
        return contexts


def _demonstration_text(
    sample: SampleRecord, *, remove_thinking: bool, max_chars: int | None, overflow: Literal["truncate", "error"]
) -> str:
    """A response as a demonstration: reasoning removed when asked, bounded to `max_chars`."""
    text = strip_thinking(sample.response_text) if remove_thinking else sample.response_text
    return fit_demonstration(text, max_chars=max_chars, overflow=overflow)


@dataclass(frozen=True, kw_only=True)
class RelaxSDPOFeedback(FeedbackPolicy):
    """The Relax variant of SDPO's teacher prompt.

    - A success gets the first other success of its group, else itself.
    - A failure gets the first success of its group; its own feedback is then dropped.
    - A failure with no success in the group gets its feedback only if it was a format error or was
      cut at the length limit (and the feedback text is non-empty).
    - Anything else: the teacher sees the prompt unchanged and the sample is masked out.

    Blocks are tagged (`<successful_attempt>`, `<feedback>`), joined by blank lines, followed by a
    closing instruction, and appended to the last user message. Reasoning is kept in demonstrations
    unless `remove_thinking_from_demonstration` is set; `max_demo_chars` bounds the demonstration.
    """

    success_threshold: float = 1.0
    remove_thinking_from_demonstration: bool = False
    max_demo_chars: int | None = None
    demo_overflow: Literal["truncate", "error"] = "truncate"

    def __post_init__(self) -> None:
        _check_threshold(self.success_threshold)
        _check_demo_policy(self.max_demo_chars, self.demo_overflow)

    def demonstration_text(self, sample: SampleRecord) -> str:
        """The text of `sample` as a demonstration for its peers."""
        return _demonstration_text(
            sample,
            remove_thinking=self.remove_thinking_from_demonstration,
            max_chars=self.max_demo_chars,
            overflow=self.demo_overflow,
        )

    def demonstrations(self, group: Sequence[SampleRecord]) -> list[int | None]:
        """The first other success of the group; a lone success gets itself."""
        _check_group(group)
        usable = _usable(self, group)
        peers = select_demonstrations(
            [s.reward for s in group],
            [s.group_id for s in group],
            success_threshold=self.success_threshold,
            exclude_self=True,
            usable=usable,
        )
        return [
            i if peer is None and sample.reward >= self.success_threshold and usable[i] else peer
            for i, (sample, peer) in enumerate(zip(group, peers, strict=True))
        ]

    def prepare_group(self, group: Sequence[SampleRecord]) -> list[TeacherContext]:
        demos = self.demonstrations(group)
        contexts = []
        for sample, demo in zip(group, demos, strict=True):
            solution = None if demo is None else self.demonstration_text(group[demo])
            feedback = None
            if solution is None and (sample.format_error or sample.truncated) and sample.feedback is not None:
                feedback = sample.feedback if sample.feedback.strip() else None
            messages = build_relax_teacher_messages(sample.prompt_messages, solution=solution, feedback=feedback)
            source = _source(solution=solution, feedback=feedback)
            contexts.append(
                TeacherContext(sample_id=sample.sample_id, messages=messages, mask=source != "none", source=source)
            )
        return contexts


FEEDBACK_POLICIES: dict[str, type[FeedbackPolicy]] = {
    "opd": OPDFeedback,
    "opsd": OPSDFeedback,
    "sdpo": SDPOFeedback,
    "sdpo_relax": RelaxSDPOFeedback,
}


def _resolve(spec: str) -> Any:
    if spec in FEEDBACK_POLICIES:
        return FEEDBACK_POLICIES[spec]
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
    elif "." in spec:
        module_name, _, attr = spec.rpartition(".")
    else:
        raise ValueError(
            f"unknown feedback policy {spec!r}; use one of {sorted(FEEDBACK_POLICIES)} "
            "or a dotted path 'package.module:ClassName'"
        )
    if not module_name or not attr:
        raise ValueError(f"malformed feedback policy path {spec!r}; expected 'package.module:ClassName'")
    module = importlib.import_module(module_name)
    if attr not in vars(module):
        raise ValueError(f"module {module_name!r} has no attribute {attr!r} (from feedback policy {spec!r})")
    return vars(module)[attr]


def feedback_class(spec: str) -> type[FeedbackPolicy]:
    """The concrete FeedbackPolicy class `spec` names: one of `FEEDBACK_POLICIES` ("opd", "opsd",
    "sdpo", "sdpo_relax") or "package.module:ClassName" / "package.module.ClassName". Raises
    ValueError for a name that resolves to nothing, TypeError for anything but a concrete policy."""
    cls = _resolve(spec)
    if not (inspect.isclass(cls) and issubclass(cls, FeedbackPolicy)):
        raise TypeError(f"{spec!r} resolves to {cls!r}, which is not a FeedbackPolicy subclass")
    if inspect.isabstract(cls):
        raise TypeError(f"{spec!r} resolves to the abstract class {cls.__name__}; pick a concrete policy")
    return cls


def feedback_parameters(cls: type[FeedbackPolicy]) -> dict[str, inspect.Parameter]:
    """The keyword arguments a policy class takes by name (a `**kwargs` of its takes no others)."""
    return {
        n: p
        for n, p in inspect.signature(cls).parameters.items()
        if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    }


def load_feedback(spec: str, kwargs: dict[str, Any] | None = None) -> FeedbackPolicy:
    """Instantiate a feedback policy from a short name or a dotted path (`feedback_class`), with
    keyword arguments. Raises TypeError for unknown or missing keyword arguments: a policy takes
    only the arguments it names."""
    cls = feedback_class(spec)
    kwargs = dict(kwargs or {})
    parameters = feedback_parameters(cls)
    accepted = list(parameters)
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise TypeError(f"{cls.__name__} got unknown kwargs {unknown}; accepted: {accepted}")
    missing = [n for n in accepted if parameters[n].default is inspect.Parameter.empty and n not in kwargs]
    if missing:
        raise TypeError(f"{cls.__name__} needs kwargs {missing}; accepted: {accepted}")
    return cls(**kwargs)
