"""Pure pieces of teacher-context building: demonstration choice, text policies and templating.

The teacher is the same model shown privileged information (a successful attempt from the group,
or the environment's feedback) inside the last user message. Everything here works on plain
strings and message lists; rendering with the chat template and tokenising happen in `tasks/`.

Template substitution never uses `str.format` on user text: prompts, demonstrations and feedback
often contain code or LaTeX with `{` and `}`, which must reach the teacher verbatim.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from sdpo_core.records import validate_messages

# Defaults of the paper's code (after YAML parsing).
SOLUTION_TEMPLATE = "\nCorrect solution:\n\n{successful_previous_attempt}"
FEEDBACK_TEMPLATE = "\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback_raw}"
REPROMPT_TEMPLATE = "{prompt}{solution}{feedback}\n\nCorrectly solve the original question."

SOLUTION_PLACEHOLDERS = ("successful_previous_attempt",)
FEEDBACK_PLACEHOLDERS = ("feedback_raw",)
REPROMPT_PLACEHOLDERS = ("prompt", "solution", "feedback")

# Tags and closing line of the Relax variant.
RELAX_SOLUTION_BLOCK = "<successful_attempt>\n{text}\n</successful_attempt>"
RELAX_FEEDBACK_BLOCK = "<feedback>\n{text}\n</feedback>"
RELAX_FINAL_LINE = "Now produce the best answer to the original problem."

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"
_THINK_BLOCK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


# --------------------------------------------------------------------------- demonstrations


def select_demonstrations(
    rewards: Sequence[float],
    group_ids: Sequence[int],
    *,
    success_threshold: float,
    exclude_self: bool,
    usable: Sequence[bool] | None = None,
) -> list[int | None]:
    """Index of each sample's demonstration: the first success of its group, or None.

    A success has reward >= `success_threshold` (and, when `usable` is given, `usable[i]`: a success
    whose demonstration text is empty, such as an answer cut off inside `<think>`, shows its peers
    nothing and must not count). "First" is by position in `rewards` (the paper's code takes the
    first by batch index, which is arbitrary but deterministic). With `exclude_self` (the paper's
    `dont_reprompt_on_self_success`), a sample never gets itself, so a lone success in a group gets
    None. Groups need not be contiguous; nothing is shared across groups.
    """
    if len(rewards) != len(group_ids):
        raise ValueError(f"rewards and group_ids differ in length: {len(rewards)} vs {len(group_ids)}")
    if usable is not None and len(usable) != len(rewards):
        raise ValueError(f"usable and rewards differ in length: {len(usable)} vs {len(rewards)}")
    if not math.isfinite(success_threshold):
        raise ValueError(f"success_threshold must be finite, got {success_threshold!r}")
    bad = [(i, r) for i, r in enumerate(rewards) if not math.isfinite(r)]
    if bad:
        raise ValueError(f"rewards must be finite; (index, reward) offenders: {bad[:8]}")

    # The first two successes per group are all that is needed: the second stands in for the first
    # when the first is the sample itself and self-demonstration is excluded.
    first_two: dict[int, list[int]] = {}
    for i, (reward, group) in enumerate(zip(rewards, group_ids, strict=True)):
        successes = first_two.setdefault(group, [])
        if reward >= success_threshold and (usable is None or usable[i]) and len(successes) < 2:
            successes.append(i)

    chosen: list[int | None] = []
    for i, group in enumerate(group_ids):
        successes = first_two[group]
        if exclude_self:
            successes = [j for j in successes if j != i]
        chosen.append(successes[0] if successes else None)
    return chosen


def strip_thinking(text: str) -> str:
    """Remove reasoning blocks from a demonstration, keeping the answer.

    - Every `<think>...</think>` block is removed together with the whitespace that follows it (the
      paper's rule).
    - A `</think>` that appears before any `<think>` means the opening tag was part of the prompt
      (chat templates of thinking models put it in the generation header): everything up to and
      including that first `</think>` and the whitespace after it is removed.
    - An unclosed `<think>` (the response ran out of tokens while reasoning) drops everything from
      that tag to the end, and trailing whitespace before it; the result can be empty.
    """
    open_at, close_at = text.find(_THINK_OPEN), text.find(_THINK_CLOSE)
    if close_at != -1 and (open_at == -1 or close_at < open_at):
        text = text[close_at + len(_THINK_CLOSE) :].lstrip()
    text = _THINK_BLOCK.sub("", text)
    open_at = text.find(_THINK_OPEN)
    if open_at != -1:
        text = text[:open_at].rstrip()
    return text


def fit_demonstration(
    text: str,
    *,
    max_chars: int | None,
    overflow: Literal["truncate", "error"],
    count_tokens: Callable[[str], int] | None = None,
    max_tokens: int | None = None,
) -> str:
    """Bound the length of a demonstration before it is templated.

    Cutting the demonstration text (never the rendered teacher prompt) keeps the original question,
    the closing instruction and the assistant header intact. "truncate" keeps the head of the text;
    "error" raises with the lengths. With `count_tokens` and `max_tokens` the bound is also applied
    in tokens; truncation then finds the longest character prefix within the budget by binary search.
    """
    if overflow not in ("truncate", "error"):
        raise ValueError(f"overflow must be 'truncate' or 'error', got {overflow!r}")
    if max_chars is not None and max_chars < 1:
        raise ValueError(f"max_chars must be >= 1 or None, got {max_chars}")
    if (count_tokens is None) != (max_tokens is None):
        raise ValueError(
            "count_tokens and max_tokens go together; got "
            f"count_tokens={'set' if count_tokens is not None else None}, max_tokens={max_tokens}"
        )
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 or None, got {max_tokens}")

    if max_chars is not None and len(text) > max_chars:
        if overflow == "error":
            raise ValueError(
                f"demonstration has {len(text)} characters, more than max_chars={max_chars}; "
                "raise max_chars or use overflow='truncate'"
            )
        text = text[:max_chars]

    if count_tokens is None or max_tokens is None:
        return text
    n_tokens = count_tokens(text)
    if n_tokens <= max_tokens:
        return text
    if overflow == "error":
        raise ValueError(
            f"demonstration has {n_tokens} tokens ({len(text)} characters), more than "
            f"max_tokens={max_tokens}; raise max_tokens or use overflow='truncate'"
        )
    empty_tokens = count_tokens("")
    if empty_tokens > max_tokens:
        raise ValueError(f"count_tokens('') = {empty_tokens} already exceeds max_tokens={max_tokens}")
    # Invariant: text[:lo] fits, text[:hi] does not.
    lo, hi = 0, len(text)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count_tokens(text[:mid]) <= max_tokens:
            lo = mid
        else:
            hi = mid
    return text[:lo]


# --------------------------------------------------------------------------- feedback rules


def select_feedback(
    feedback: str | None,
    *,
    has_solution: bool,
    include_environment_feedback: bool,
    environment_feedback_only_without_solution: bool,
) -> str | None:
    """The environment feedback the teacher gets, or None (the paper's two flags).

    Empty or whitespace-only feedback counts as none. With `environment_feedback_only_without_solution`
    the feedback is used only for samples that got no demonstration.
    """
    if not include_environment_feedback or feedback is None or not feedback.strip():
        return None
    if environment_feedback_only_without_solution and has_solution:
        return None
    return feedback


# --------------------------------------------------------------------------- templating


def check_template(template: str, *, required: Sequence[str], what: str) -> None:
    """Raise unless `template` holds each required `{name}` and no other `{identifier}`.

    Only the exact `{name}` tokens are placeholders; any other brace text is literal. An unknown
    `{identifier}` is rejected because it is almost always a misspelt placeholder.
    """
    if not isinstance(template, str):
        raise TypeError(f"{what} must be a str, got {type(template).__name__}")
    found = set(_PLACEHOLDER.findall(template))
    missing = [name for name in required if name not in found]
    unknown = sorted(found - set(required))
    if missing or unknown:
        raise ValueError(
            f"{what} {template!r}: missing placeholders {['{' + n + '}' for n in missing]}, "
            f"unknown placeholders {['{' + n + '}' for n in unknown]}; "
            f"it must contain exactly the placeholders {['{' + n + '}' for n in required]}"
        )


def substitute(template: str, values: Mapping[str, str]) -> str:
    """Replace `{name}` for each name in `values`, in one pass.

    Unlike `str.format`, inserted text is never re-scanned and braces anywhere else stay verbatim.
    """

    def replace(match: re.Match[str]) -> str:
        name = match.group(1)
        return values[name] if name in values else match.group(0)

    return _PLACEHOLDER.sub(replace, template)


def render_reprompt(
    prompt: str,
    *,
    solution: str | None,
    feedback: str | None,
    solution_template: str = SOLUTION_TEMPLATE,
    feedback_template: str = FEEDBACK_TEMPLATE,
    reprompt_template: str = REPROMPT_TEMPLATE,
) -> str:
    """The teacher's user-message text: the prompt with the demonstration and/or feedback woven in.

    With neither a solution nor feedback the prompt is returned unchanged.
    """
    check_template(solution_template, required=SOLUTION_PLACEHOLDERS, what="solution_template")
    check_template(feedback_template, required=FEEDBACK_PLACEHOLDERS, what="feedback_template")
    check_template(reprompt_template, required=REPROMPT_PLACEHOLDERS, what="reprompt_template")
    if solution is None and feedback is None:
        return prompt
    solution_text = "" if solution is None else substitute(solution_template, {"successful_previous_attempt": solution})
    feedback_text = "" if feedback is None else substitute(feedback_template, {"feedback_raw": feedback})
    return substitute(reprompt_template, {"prompt": prompt, "solution": solution_text, "feedback": feedback_text})


def last_user_index(messages: Sequence[dict[str, Any]]) -> int:
    """Position of the last user message; raises if there is none."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "user":
            return i
    raise ValueError(
        f"the prompt has no user message to carry the teacher's privileged text; roles: {[m['role'] for m in messages]}"
    )


def replace_last_user_content(messages: Sequence[dict[str, Any]], content: str) -> tuple[dict[str, Any], ...]:
    """A deep copy of `messages` whose last user message has `content`; the input is not touched."""
    validate_messages(messages, what="prompt messages")
    index = last_user_index(messages)
    out = copy.deepcopy(list(messages))
    out[index]["content"] = content
    return tuple(out)


def build_teacher_messages(
    prompt_messages: Sequence[dict[str, Any]],
    *,
    solution: str | None,
    feedback: str | None,
    solution_template: str = SOLUTION_TEMPLATE,
    feedback_template: str = FEEDBACK_TEMPLATE,
    reprompt_template: str = REPROMPT_TEMPLATE,
) -> tuple[dict[str, Any], ...]:
    """The teacher's message list in the paper's format.

    All messages are kept as they are (system messages included) except the last user message, whose
    content becomes the reprompt text. For a single-turn prompt this equals the paper's "system
    messages + one user message"; for a multi-turn prompt earlier turns are kept so the teacher sees
    the same conversation as the student. With neither a solution nor feedback the result is a copy
    of the input. The input is never mutated.
    """
    validate_messages(prompt_messages, what="prompt messages")
    index = last_user_index(prompt_messages)
    if solution is None and feedback is None:
        return tuple(copy.deepcopy(list(prompt_messages)))
    text = render_reprompt(
        prompt_messages[index]["content"],
        solution=solution,
        feedback=feedback,
        solution_template=solution_template,
        feedback_template=feedback_template,
        reprompt_template=reprompt_template,
    )
    return replace_last_user_content(prompt_messages, text)


def render_relax_suffix(*, solution: str | None, feedback: str | None) -> str | None:
    """The Relax variant's privileged text: tagged blocks joined by blank lines, then the final line.

    Returns None when there is nothing to inject.
    """
    blocks = []
    if solution is not None:
        blocks.append(substitute(RELAX_SOLUTION_BLOCK, {"text": solution}))
    if feedback is not None:
        blocks.append(substitute(RELAX_FEEDBACK_BLOCK, {"text": feedback}))
    if not blocks:
        return None
    return "\n\n".join([*blocks, RELAX_FINAL_LINE])


def build_relax_teacher_messages(
    prompt_messages: Sequence[dict[str, Any]],
    *,
    solution: str | None,
    feedback: str | None,
) -> tuple[dict[str, Any], ...]:
    """The teacher's message list in the Relax format: the suffix appended to the last user message.

    With nothing to inject the result is a copy of the input. The input is never mutated.
    """
    validate_messages(prompt_messages, what="prompt messages")
    index = last_user_index(prompt_messages)
    suffix = render_relax_suffix(solution=solution, feedback=feedback)
    if suffix is None:
        return tuple(copy.deepcopy(list(prompt_messages)))
    return replace_last_user_content(prompt_messages, f"{prompt_messages[index]['content']}\n\n{suffix}")
