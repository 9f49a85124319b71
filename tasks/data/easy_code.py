"""Easy generated code tasks: one small Python function each, judged by functional tests.

A task a 135M instruction model passes sometimes, for the study of rich feedback against a scalar
reward on code (docs/results.md): "Write a Python function `count_vowels(s)` that returns the number
of vowels (a, e, i, o, u) in s. Put the code in a ```python block.", and five calls of the function
whose return values the code verifier compares (`sdpo_core.verifiers.code`, test type
`functional`), so a wrong answer's feedback shows an input, the output and the expected value.

Ten families, from one-liners SmolLM2-135M-Instruct writes correctly at T = 0 (reverse a string)
to ones it never does (count the vowels, sort in descending order): it passes half of them
greedily and about 10 % of its samples at T = 1 (docs/results.md §5.5). Pure and deterministic for a seed; no
I/O. A question is a (family, parameter, name) triple: its tests are drawn from a generator seeded
by the question, so both splits hold the same tests for it whatever the split seed.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["DATA_SOURCE", "FAMILIES", "make_splits"]

DATA_SOURCE = "easy_code"
INSTRUCTION = "Write a Python function `{name}({args})` that {description}. Put the code in a ```python block."
WORDS = ("apple", "river", "stone", "light", "Table", "green", "Otter", "python", "music", "cloud", "Maple", "sky")
TESTS = 5


def _ints(r: random.Random) -> list[int]:
    return [r.randint(-20, 20) for _ in range(r.randint(2, 6))]


@dataclass(frozen=True)
class Family:
    """Functions of one kind: names (with `{k}` where the parameter shows), the argument list, the
    description, the reference implementation f(k, argument) and a generator of arguments."""

    names: tuple[str, ...]
    args: str
    description: str
    reference: Callable[[int, Any], Any]
    argument: Callable[[random.Random], Any]
    parameters: tuple[int, ...] = (0,)


FAMILIES: dict[str, Family] = {
    "reverse": Family(("reverse_string", "reversed_text", "backwards"), "s", "returns the string s reversed",
                      lambda k, s: s[::-1], lambda r: r.choice(WORDS)),
    "vowels": Family(("count_vowels", "vowel_count", "number_of_vowels"), "s",
                     "returns the number of vowels (a, e, i, o, u) in s",
                     lambda k, s: sum(c in "aeiou" for c in s), lambda r: r.choice(WORDS)),
    "sum_even": Family(("sum_even", "even_total", "add_evens"), "xs", "returns the sum of the even numbers in the list xs",
                       lambda k, xs: sum(x for x in xs if x % 2 == 0), _ints),
    "sort_desc": Family(("sort_desc", "descending", "largest_first"), "xs",
                        "returns the list xs sorted from largest to smallest",
                        lambda k, xs: sorted(xs, reverse=True), _ints),
    "last": Family(("last_item", "final_element", "get_last"), "xs", "returns the last element of the list xs",
                   lambda k, xs: xs[-1], _ints),
    "count_above": Family(("count_above_{k}", "how_many_over_{k}", "greater_than_{k}"), "xs",
                          "returns how many numbers in the list xs are greater than {k}",
                          lambda k, xs: sum(x > k for x in xs), _ints, tuple(range(2, 8))),
    "capitalise": Family(("first_upper", "capitalise_first", "upper_initial"), "s",
                         "returns s with its first letter in upper case and the rest unchanged",
                         lambda k, s: s[:1].upper() + s[1:], lambda r: r.choice(WORDS).lower()),
    "repeat": Family(("repeat_{k}", "times_{k}", "copies_{k}"), "s", "returns the string s repeated {k} times",
                     lambda k, s: s * k, lambda r: r.choice(WORDS), tuple(range(2, 6))),
    "spread": Family(("max_minus_min", "value_range", "spread"), "xs",
                     "returns the largest number in the list xs minus the smallest",
                     lambda k, xs: max(xs) - min(xs), _ints),
    "halve": Family(("halve", "half_down", "floor_half"), "x", "returns x divided by 2, rounded down to an integer",
                    lambda k, x: x // 2, lambda r: r.randint(-50, 50)),
}  # fmt: skip


def task_row(family: str, name_index: int, k: int) -> dict[str, Any]:
    """The data-set row of one question (the code verifier's functional label, five calls)."""
    spec = FAMILIES[family]
    name = spec.names[name_index].format(k=k)
    tests = random.Random(f"{family}:{name}:{k}")
    arguments = [spec.argument(tests) for _ in range(TESTS)]
    label = {
        "testtype": "functional",
        "inputs": [json.dumps(a) for a in arguments],
        "outputs": [json.dumps(spec.reference(k, a)) for a in arguments],
        "fn_name": name,
        "time_limit": None,
        "setup": "",
        "entry_points": [],
    }
    text = INSTRUCTION.format(name=name, args=spec.args, description=spec.description.format(k=k))
    return {
        "prompt_id": f"code-{name}",
        "prompt_messages": [{"role": "user", "content": text}],
        "label": json.dumps(label),
        "data_source": DATA_SOURCE,
        "metadata": {"family": family},
    }


def make_splits(*, seed: int, eval_fraction: float) -> tuple[list[dict], list[dict]]:
    """Every question of every family, shuffled with `seed`, the first `eval_fraction` (at least one)
    held out."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    rows = [
        task_row(family, i, k)
        for family, spec in FAMILIES.items()
        for i in range(len(spec.names))
        for k in spec.parameters
    ]
    random.Random(f"easy-code-split:{seed}").shuffle(rows)
    cut = min(max(1, round(eval_fraction * len(rows))), len(rows) - 1)
    return rows[cut:], rows[:cut]
