"""The offline demo task: two-operand addition prompts with integer labels.

Pure and deterministic for a seed; no I/O. Rows have the data-set schema the rollout stage reads:
`prompt_id`, `prompt_messages` (chat messages), `label` and `data_source`.

A problem is the unordered pair {a, b}: "37+45=" and "45+37=" always land in the same split, so the
held-out split measures addition the model has not seen in either order.
"""

from __future__ import annotations

import random

__all__ = ["DATA_SOURCE", "PROMPT_TEMPLATE", "addition_row", "make_splits"]

DATA_SOURCE = "arithmetic"


PROMPT_TEMPLATE = "{a}+{b}="


def addition_row(a: int, b: int, *, answer_width: int = 0, template: str = PROMPT_TEMPLATE) -> dict:
    """One data-set row for the prompt `template` filled with a and b ("a+b=" by default; no system
    message: sequences stay short). The prompt id names the operands whatever the template.

    `answer_width` > 0 zero-pads the label to that many digits: every answer then has the same
    length, so each answer position means the same digit whatever was sampled before it.
    """
    return {
        "prompt_id": f"add-{a}-{b}",
        "prompt_messages": [{"role": "user", "content": template.format(a=a, b=b)}],
        "label": str(a + b).zfill(answer_width),
        "data_source": DATA_SOURCE,
    }


def make_splits(
    *,
    seed: int,
    max_operand: int,
    eval_fraction: float,
    min_operand: int = 0,
    answer_width: int = 0,
    template: str = PROMPT_TEMPLATE,
) -> tuple[list[dict], list[dict]]:
    """All prompts a+b= (in `template`'s words) with operands in [min_operand, max_operand], split into (train, eval).

    The unordered pairs are shuffled with `seed` and the first `eval_fraction` of them (at least
    one) go to eval; both orders of a pair follow it. Rows within each split are shuffled too.
    """
    if not 0 <= min_operand <= max_operand:
        raise ValueError(f"need 0 <= min_operand <= max_operand, got {min_operand=}, {max_operand=}")
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    if answer_width and len(str(2 * max_operand)) > answer_width:
        raise ValueError(f"answer_width={answer_width} cannot hold the largest sum {2 * max_operand}")
    operands = range(min_operand, max_operand + 1)
    pairs = [(a, b) for a in operands for b in operands if a <= b]
    if len(pairs) < 2:
        raise ValueError(f"operand range [{min_operand}, {max_operand}] gives {len(pairs)} problem(s); need >= 2")
    rng = random.Random(seed)
    rng.shuffle(pairs)
    num_eval = min(max(1, round(eval_fraction * len(pairs))), len(pairs) - 1)
    splits = []
    for chunk in (pairs[num_eval:], pairs[:num_eval]):
        rows = [addition_row(a, b, answer_width=answer_width, template=template) for a, b in chunk]
        rows += [addition_row(b, a, answer_width=answer_width, template=template) for a, b in chunk if a != b]
        rng.shuffle(rows)
        splits.append(rows)
    return splits[0], splits[1]
