"""The code sandbox runs real programs: correct ones pass, and escape attempts are contained and come
back as test results, never as a crash or a hang of this process.

Each escape test runs under every isolation level available here: namespaces with the Python guard,
namespaces alone (the OS-level defences without the audit hook), and the opt-in plain-process level
(rlimits plus the guard)."""

from __future__ import annotations

import json
import os
import random
import socket
import time
from pathlib import Path

import pytest

from sdpo_core.verifiers.code import TestSuite, suite_to_label
from tasks.sandbox.program import _UID_RANGE, SandboxLimits, namespace_isolation_available, run_program, verify_code

NAMESPACES = namespace_isolation_available()
needs_namespaces = pytest.mark.skipif(not NAMESPACES, reason="namespace isolation needs root and unshare")

# Generous per-test time for programs that should finish (the machine is shared and may be slow);
# tests that expect a time-out use `short(limits)`.
FAST = dict(per_test_s=3.0, total_s=8.0, memory_mb=512, file_mb=2)
LEVELS = {
    "namespace+guard": pytest.param(
        SandboxLimits(isolation="namespace", **FAST), marks=needs_namespaces, id="namespace+guard"
    ),
    "namespace-only": pytest.param(
        SandboxLimits(isolation="namespace", python_guard=False, **FAST), marks=needs_namespaces, id="namespace-only"
    ),
    "process": pytest.param(SandboxLimits(isolation="process", **FAST), id="process"),
}
ALL = list(LEVELS.values())
NAMESPACE_LEVELS = [LEVELS["namespace+guard"], LEVELS["namespace-only"]]
ONE = TestSuite(testtype="stdin", inputs=["\n"], outputs=["ok\n"])
CANARY = "canary-7c1f0e9b"  # appears in this file, so a program that can read the repository would print it


def short(limits: SandboxLimits, **changes) -> SandboxLimits:
    return SandboxLimits(**{**limits.__dict__, "per_test_s": 0.5, **changes})


def one(program: str, limits: SandboxLimits, suite: TestSuite = ONE):
    return run_program(program, suite, limits=limits)[0]


class _UidRecorder:
    """Stands in for `random` inside the sandbox module and keeps the uids its runs were given, so
    the leftover check sees this process's sandboxes only: `make test` runs test files in parallel
    workers, and another worker's sandbox (under another random uid) may be alive meanwhile."""

    def __init__(self) -> None:
        self.uids: set[int] = set()

    def randrange(self, start: int, stop: int) -> int:
        uid = random.randrange(start, stop)
        self.uids.add(uid)
        return uid


_OWN = _UidRecorder()


@pytest.fixture(autouse=True)
def _record_sandbox_uids(monkeypatch):
    import tasks.sandbox.program

    monkeypatch.setattr(tasks.sandbox.program, "random", _OWN)


def sandbox_processes() -> list[int]:
    """Pids of live processes running under a uid this process's sandbox runs were given (leftovers
    of a run)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue  # the process ended while we looked
        uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
        state = next(line for line in status.splitlines() if line.startswith("State:")).split()[1]
        if uid in _OWN.uids and _UID_RANGE[0] <= uid < _UID_RANGE[1] and state != "Z":
            found.append(int(entry.name))
    return found


def assert_no_leftovers(timeout: float = 3.0) -> None:
    assert _OWN.uids or not NAMESPACES, "no sandbox uid recorded: the check below would see nothing"
    deadline = time.monotonic() + timeout
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes() == []


# -- programs that should work ----------------------------------------------------------------------
@pytest.mark.parametrize("limits", ALL)
def test_stdin_programs_in_common_styles_produce_their_output(limits):
    suite = TestSuite(testtype="stdin", inputs=["1 2\n", "10 20\n"], outputs=["3\n", "30\n"])
    programs = [
        "a, b = map(int, input().split())\nprint(a + b)",
        "import sys\nprint(sum(map(int, sys.stdin.buffer.read().split())))",
        "print(sum(map(int, open(0).read().split())))",
        "import os, sys\ndata = sys.stdin.read().split()\nos.write(1, (str(int(data[0]) + int(data[1])) + '\\n').encode())",
        "import sys\nprint(sum(map(int, input().split())))\nsys.exit(0)",
    ]
    for program in programs:
        executions = run_program(program, suite, limits=limits)
        assert [(e.status, e.output.strip()) for e in executions] == [("ok", "3"), ("ok", "30")], program


@pytest.mark.parametrize("limits", ALL)
def test_functional_tests_call_the_solution_method(limits):
    suite = TestSuite(
        testtype="functional", inputs=["[1, 1, 1]\n2", "[5]\n5"], outputs=["3", "0"], fn_name="countPairs"
    )
    program = (  # no typing import: LeetCode's environment provides List, as the harness does
        "class Solution:\n    def countPairs(self, nums: List[int], target: int) -> int:\n"
        "        print('debug', len(nums))\n"
        "        return sum(nums[i] + nums[j] == target for i in range(len(nums)) for j in range(i + 1, len(nums)))\n"
    )
    executions = run_program(program + "\nif __name__ == '__main__':\n    print(input())\n", suite, limits=limits)
    assert [(e.status, e.output) for e in executions] == [("ok", "3"), ("ok", "0")]  # the main block did not run
    assert executions[0].stderr == "debug 3"  # prints of a call-based solution are debug output


@pytest.mark.parametrize("limits", ALL)
def test_assert_tests_run_after_the_setup(limits):
    suite = TestSuite(
        testtype="assert",
        inputs=["check(add)", "assert add(1, 1) == 3"],
        setup="def check(candidate):\n    assert candidate(2, 3) == 5\n",
        entry_points=["add"],
    )
    executions = run_program("def add(a, b):\n    return a + b\n", suite, limits=limits)
    assert [e.status for e in executions] == ["ok", "failed"]
    assert executions[1].error.startswith("AssertionError")


@pytest.mark.parametrize("limits", ALL)
def test_a_syntax_error_is_reported_on_the_first_test(limits):
    executions = run_program("def f(:\n  pass", ONE, limits=limits)
    assert executions[0].status == "error" and executions[0].error.startswith("SyntaxError")


@pytest.mark.parametrize("limits", ALL)
def test_runtime_errors_name_the_line(limits):
    execution = one("x = 1\ny = 0\nprint(x / y)", limits)
    assert execution.status == "error"
    assert execution.error.splitlines() == ["ZeroDivisionError: division by zero", "Line 3 in <module>: print(x / y)"]


# -- escape attempts --------------------------------------------------------------------------------
@pytest.mark.parametrize("limits", ALL)
def test_reading_the_repository_fails(limits):
    execution = one(f"print(open({str(Path(__file__).resolve())!r}).read())", limits)
    assert execution.status == "error" and CANARY not in execution.output
    assert execution.error.startswith(("FileNotFoundError", "PermissionError"))


@pytest.mark.parametrize("limits", ALL)
def test_reading_a_file_outside_the_working_directory_fails(limits, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text(CANARY)
    for program in (
        f"print(open({str(secret)!r}).read())",
        f"import os\nprint(os.listdir({str(tmp_path)!r}))",
        "print(open('/etc/passwd').read())",
        "import os\nos.chdir('..')\nprint(open('../../etc/hostname').read())",
    ):
        execution = one(program, limits)
        assert execution.status == "error", program
        assert CANARY not in execution.output and "secret" not in execution.output


@needs_namespaces
@pytest.mark.parametrize("limits", NAMESPACE_LEVELS)
def test_the_namespace_root_holds_no_repository_home_or_tmp(limits):
    execution = one("import os\nprint(sorted(os.listdir('/')))\nprint(os.getcwd(), os.getuid())", limits)
    if limits.python_guard:  # the guard refuses listing outside the working directory
        assert execution.status == "error" and "not allowed" in execution.error
        return
    listing, where = execution.output.splitlines()
    assert set(json.loads(listing.replace("'", '"'))) <= {
        "bin",
        "dev",
        "harness.py",
        "job.json",
        "lib",
        "lib64",
        "root",
        "sandbox_codec.py",
        "sandbox_judge.py",
        "sandbox_extensions.py",
        "sandbox_guard.py",
        "sandbox_runner.py",
        "sandbox",
        "sbin",
        "usr",
    }
    cwd, uid = where.split()
    assert cwd == "/sandbox" and _UID_RANGE[0] <= int(uid) < _UID_RANGE[1]


@pytest.mark.parametrize("limits", ALL)
def test_the_environment_is_scrubbed_and_home_is_the_working_directory(limits, monkeypatch):
    monkeypatch.setenv("SDPO_SANDBOX_CANARY", CANARY)
    execution = one("import os\nprint(sorted(os.environ))\nprint(os.environ['HOME'] == os.getcwd())", limits)
    names, home_is_cwd = execution.output.splitlines()
    assert set(json.loads(names.replace("'", '"'))) <= {"PATH", "HOME", "TMPDIR", "LANG", "LC_ALL"}
    assert home_is_cwd == "True" and CANARY not in execution.output


@pytest.mark.parametrize("limits", ALL)
def test_each_run_gets_a_fresh_working_directory(limits):
    assert one("open('left_behind.txt', 'w').write('x')\nprint('ok')", limits).status == "ok"
    execution = one("import os\nprint([n for n in os.listdir('.') if not n.startswith('.')])", limits)
    assert execution.output.strip() == "[]"


@pytest.fixture
def listening_port():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    with socket.create_connection(("127.0.0.1", server.getsockname()[1]), timeout=1):
        pass  # control: outside the sandbox the port accepts connections
    yield server.getsockname()[1]
    server.close()


@pytest.mark.parametrize("limits", ALL)
def test_network_connections_fail(limits, listening_port):
    program = (
        "import socket\ns = socket.socket()\ns.settimeout(1)\n"
        f"s.connect(('127.0.0.1', {listening_port}))\nprint('connected')"
    )
    execution = one(program, limits)
    assert execution.status == "error" and "connected" not in execution.output
    # the guard refuses the socket module itself (tasks/sandbox/extensions.py)
    expected = "ImportError: sandbox" if limits.python_guard else "OSError: [Errno 101] Network is unreachable"
    assert execution.error.startswith(expected)


@pytest.mark.parametrize("limits", ALL)
def test_an_infinite_loop_hits_the_time_limit_and_stops_the_run(limits):
    suite = TestSuite(testtype="stdin", inputs=["a", "b"], outputs=["x", "y"])
    limits = short(limits)
    started = time.monotonic()
    executions = run_program("while True:\n    pass", suite, limits=limits)
    assert [e.status for e in executions] == ["timeout", "not_run"]
    assert time.monotonic() - started < limits.per_test_s + 3.0


@pytest.mark.parametrize("limits", ALL)
def test_a_suite_time_limit_lowers_the_per_test_limit(limits):
    suite = TestSuite(testtype="stdin", inputs=["a"], outputs=["x"], time_limit=0.2)
    started = time.monotonic()
    assert one("import time\ntime.sleep(30)", limits, suite).status == "timeout"
    assert time.monotonic() - started < 2.5


@pytest.mark.parametrize("limits", ALL)
def test_the_total_time_limit_bounds_the_whole_run(limits):
    suite = TestSuite(testtype="stdin", inputs=[str(i) for i in range(10)], outputs=["x"] * 10)
    started = time.monotonic()
    total = SandboxLimits(**{**limits.__dict__, "total_s": 1.5})
    executions = run_program("import time\ntime.sleep(0.2)\nprint('x')", suite, limits=total)
    statuses = [e.status for e in executions]
    assert "timeout" in statuses and statuses[-1] == "not_run" and statuses[0] == "ok"
    assert "total time limit" in executions[statuses.index("timeout")].error
    assert time.monotonic() - started < 3.5


@pytest.mark.parametrize("limits", ALL)
def test_a_fork_bomb_is_contained(limits):
    program = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    limits = short(limits)
    started = time.monotonic()
    execution = one(program, limits)
    assert execution.status in ("timeout", "error")
    assert time.monotonic() - started < limits.per_test_s + 3.0
    assert_no_leftovers()


@needs_namespaces
def test_background_processes_die_with_the_sandbox():
    limits = SandboxLimits(isolation="namespace", python_guard=False, **FAST)
    program = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('ok')"
    assert one(program, limits).status == "ok"
    assert_no_leftovers()


@pytest.mark.parametrize("limits", ALL)
def test_huge_allocations_fail_with_memory_error(limits):
    limits = SandboxLimits(**{**limits.__dict__, "memory_mb": 200})
    for program in ("x = bytearray(8 * 2**30)", "chunks = []\nwhile True:\n    chunks.append(bytearray(20 * 2**20))"):
        execution = one(program, limits)
        assert execution.status == "error" and execution.error.startswith("MemoryError"), program


@pytest.mark.parametrize("limits", ALL)
def test_writing_a_huge_file_or_output_fails(limits):
    big_file = one("open('big.bin', 'wb').write(b'0' * (3 * 2**20))", limits)
    assert big_file.status == "error" and "File too large" in big_file.error
    flood = one("while True:\n    print('x' * 10000)", limits)
    assert flood.status == "error" and flood.error.startswith("Output Limit Exceeded")


@pytest.mark.parametrize("limits", ALL)
def test_a_huge_return_value_exceeds_the_output_limit(limits):
    suite = TestSuite(testtype="functional", inputs=["1"], outputs=["[]"], fn_name="f")
    execution = one("def f(n):\n    return [0] * 800_000  # 2.4 MB of JSON, over file_mb=2", limits, suite)
    assert execution.status == "error" and execution.error.startswith("Output Limit Exceeded")
    assert execution.output == ""


@pytest.mark.parametrize("limits", ALL)
def test_killing_the_parent_is_contained(limits):
    for program in (
        "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('ok')",
        "import os, signal\nos.killpg(os.getpgid(0), signal.SIGKILL)\nprint('ok')",
    ):
        execution = one(program, limits)
        assert execution.status in ("error", "ok"), program
    # this test process is still here to check the verdicts; the sandbox reported instead of hanging


@needs_namespaces
@pytest.mark.parametrize("limits", NAMESPACE_LEVELS)
def test_killing_every_process_it_can_reaches_only_the_sandbox(limits):
    execution = one("import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('ok')", limits)
    assert execution.status in ("error", "ok")
    assert_no_leftovers()


@pytest.mark.parametrize("limits", ALL)
def test_exiting_the_interpreter_fails_the_test_and_the_next_one_runs_afresh(limits):
    suite = TestSuite(testtype="stdin", inputs=["a", "b"], outputs=["x", "y"])
    executions = run_program("import os\nif input() == 'a':\n    os._exit(3)\nprint('y')", suite, limits=limits)
    assert [e.status for e in executions] == ["error", "ok"]
    assert "exit status 3" in executions[0].error


@pytest.mark.parametrize("limits", ALL)
def test_unbounded_recursion_is_contained(limits):
    program = "import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return f(n + 1) + 1\nf(0)"
    limits = short(limits)
    started = time.monotonic()
    execution = one(program, limits)
    assert execution.status in ("error", "timeout")  # the frames fill the memory limit, or the clock runs out first
    assert time.monotonic() - started < limits.per_test_s + 3.0


@pytest.mark.parametrize("limits", ALL)
def test_native_code_is_refused_by_the_guard_or_crashes_alone(limits):
    execution = one("import ctypes\nctypes.string_at(0)", limits)
    assert execution.status == "error"
    if limits.python_guard:
        assert "not allowed" in execution.error
    else:
        assert "SIGSEGV" in execution.error


@pytest.mark.parametrize("limits", ALL)
def test_garbage_on_the_report_channel_is_an_error_not_a_crash(limits):
    program = (
        "import os\nfor fd in range(3, 4096):\n    try:\n        os.write(fd, b'garbage\\n')\n    except OSError:\n"
        "        pass\nprint('ok')"
    )
    suite = TestSuite(testtype="stdin", inputs=["a", "b"], outputs=["ok", "ok"])
    executions = run_program(program, suite, limits=limits)
    assert all(e.status == "error" and "report channel" in e.error for e in executions), executions


# -- the verifier wired to the sandbox --------------------------------------------------------------
LABEL = suite_to_label(TestSuite(testtype="stdin", inputs=["1 2\n", "5 0\n"], outputs=["3\n", "5\n"], time_limit=1.0))


def test_verify_code_scores_a_correct_program():
    verdict = verify_code("```python\nprint(sum(map(int, input().split())))\n```", LABEL, truncated=False, **FAST)
    assert verdict.reward == 1.0 and verdict.feedback is None


def test_verify_code_returns_leetcode_feedback_for_a_runtime_error():
    response = "```python\na, b = map(int, input().split())\nprint(a // b)\n```"
    verdict = verify_code(response, LABEL, truncated=False, **FAST)
    assert verdict.reward == 0.0
    assert verdict.feedback == (
        "Runtime Error\nZeroDivisionError: integer division or modulo by zero\nLine 2 in <module>: print(a // b)\n\n"
        "Last Executed Input\n5 0"
    )


def test_verify_code_returns_a_time_limit_verdict():
    verdict = verify_code("```python\nwhile True: pass\n```", LABEL, truncated=False, **{**FAST, "per_test_s": 0.5})
    assert verdict.reward == 0.0 and verdict.feedback.startswith("Time Limit Exceeded\n\nLast Executed Input\n1 2")


def test_process_isolation_requires_the_guard():
    with pytest.raises(ValueError, match="python_guard"):
        SandboxLimits(isolation="process", python_guard=False)


def test_sandbox_leaves_no_temporary_directories(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    one("print('ok')", SandboxLimits(isolation="process", **FAST))
    assert list(tmp_path.iterdir()) == []
    assert os.path.isdir(tmp_path)


def test_one_answer_cannot_fail_the_batch(monkeypatch):
    """Return values the comparison used to raise on, and a verifier that fails on one answer: each
    such answer scores 0 with the reason and the others keep their verdicts."""
    import tasks.rollout as rollout
    import tasks.sandbox.program as sandbox
    from tasks.config import load_config

    cfg = load_config(
        None, ["verifier.name=code", "verifier.kwargs={per_test_s: 3.0, total_s: 8.0, memory_mb: 512, file_mb: 2}"]
    )
    label = suite_to_label(TestSuite(testtype="functional", inputs=["2\n3"], outputs=["5"], fn_name="add"))
    answers = [
        "def add(a, b):\n    return a + b\n",
        "def add(a, b):\n    return 10 ** 400\n",  # OverflowError in the comparison with 5
        "import sys\nsys.set_int_max_str_digits(0)\ndef add(a, b):\n    return 10 ** 5000\n",  # the int string limit
        "def add(a, b):\n    return a + b  # boom\n",
        "def add(a, b):\n    return a - b\n",
    ]
    real = sandbox.verify_code

    def failing_on_boom(text, label, **kwargs):
        if "boom" in text:
            raise KeyError("a bug that only this answer reaches")
        return real(text, label, **kwargs)

    monkeypatch.setattr(sandbox, "verify_code", failing_on_boom)
    verdicts = rollout.verify_all(cfg, [(f"```python\n{a}```", label, False) for a in answers])
    assert [v.reward for v in verdicts] == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert verdicts[1].feedback.startswith("Test Case 1: Wrong Answer")
    assert "could not be checked" in verdicts[3].feedback and "KeyError" in verdicts[3].feedback
    with pytest.raises((ValueError, KeyError)):  # a malformed label is a data error: it stops the batch
        rollout.verify_all(cfg, [("```python\npass\n```", '{"inputs": ["1"]}', False)])
