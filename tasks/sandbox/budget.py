"""A per-answer time budget around the pure verifiers.

The verifiers are bounded by construction (linear parsing, depth, size and digit limits), and this
is the guarantee on top: each call runs in a worker process (started once, with only
`sdpo_core.verifiers` imported) and is given `budget_s` seconds. A call that overruns, whatever
it is stuck in (a regular expression, a C-level big-number operation, sympy), has its worker
killed and scores 0 with feedback saying so; the next call starts a fresh worker. So one answer
can never stall a rollout. Nor can it fail one: a verifier that raises on an answer, or whose worker
dies on it, gives that answer 0 with the error as its feedback (`failure_verdict`, logged with its
traceback) and the batch goes on. A malformed label still raises (`ValueError`, as in-process),
since that is a data error, not a verdict on the answer: when a call fails, the worker calls the
verifier again on the label alone (`truncated=True`, which every verifier answers after reading its
label and before reading the answer) to tell the two apart.

`many` judges a rollout's answers in one pass: every request goes down the pipe at once (a writer
thread) and the answers come back in order, each within its budget, so 512 answers cost one
worker's verifying time instead of 512 round trips between the processes (45 ms of round trips
on two CPU cores). An overrun kills the worker; the answers after it go to a fresh one.

The code verifier is not run here: it is bounded by its sandbox's `total_s` (tasks/sandbox/program.py).
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any

from sdpo_core.records import Verdict

__all__ = ["BudgetedVerifier", "failure_verdict", "overrun_verdict"]

logger = logging.getLogger(__name__)

_START_S = 60.0  # a fresh worker's interpreter start and imports (not counted in the budget)


def overrun_verdict(budget_s: float) -> Verdict:
    return Verdict(
        reward=0.0,
        feedback=f"The answer could not be checked within {budget_s:g} seconds; give a shorter, plainer final answer.",
    )


def failure_verdict(reason: str) -> Verdict:
    """The verdict of an answer the verifier failed on (a bug, not a judgement): 0, saying why."""
    return Verdict(reward=0.0, feedback=f"The answer could not be checked: the verifier failed ({reason[:500]}).")


def _serve(name: str, kwargs: dict[str, Any]) -> None:
    """The worker: one JSON request per line on stdin, one JSON answer per line on stdout."""
    from sdpo_core.verifiers import VERIFIERS

    verifier = VERIFIERS[name]
    out, sys.stdout = sys.stdout, sys.stderr  # what a verifier prints cannot break the answer lines
    out.write(json.dumps(["ready", None]) + "\n")
    out.flush()
    for line in sys.stdin:
        text, label, truncated = json.loads(line)
        try:
            verdict = verifier(text, label, truncated=truncated, **kwargs)
        except Exception as err:  # noqa: BLE001 -- the boundary that keeps one answer's failure its own
            answer = _failure(verifier, label, kwargs, err)
        else:
            answer = ["ok", [verdict.reward, verdict.feedback, verdict.format_error, verdict.truncated]]
        out.write(json.dumps(answer) + "\n")
        out.flush()


def _failure(verifier: Any, label: str, kwargs: dict[str, Any], err: Exception) -> list[Any]:
    """["label", message] when the label itself is malformed (re-raised in the caller), else
    ["failed", "Type: message", traceback] (the answer scores 0)."""
    try:
        verifier("", label, truncated=True, **kwargs)  # reads the label, judges nothing
    except Exception as label_err:  # noqa: BLE001 -- any failure on the label alone is the label's
        return ["label", str(label_err)]
    return ["failed", f"{type(err).__name__}: {err}", traceback.format_exc()]


class _WorkerDied(Exception):
    """The worker's pipe closed: it died (on the answer being judged, or while starting)."""


class BudgetedVerifier:
    """`verify(response_text, label, *, truncated)` of the verifier `name` with `kwargs`, each call
    limited to `budget_s` seconds of wall-clock time."""

    def __init__(self, name: str, kwargs: dict[str, Any], *, budget_s: float) -> None:
        if not budget_s > 0:
            raise ValueError(f"budget_s must be > 0, got {budget_s}")
        self.name, self.kwargs, self.budget_s = name, dict(kwargs), budget_s
        self._process: subprocess.Popen | None = None
        self._pending = b""  # answer bytes read from the worker, not yet a whole line
        self._writer: threading.Thread | None = None  # sending the requests of `many`

    def _answer(self, timeout: float) -> list[Any] | None:
        """The worker's next answer line, or None when none came within `timeout` seconds. Reads the
        pipe itself (no buffered reader), so answers that arrived together are never missed by select."""
        assert self._process is not None and self._process.stdout is not None
        fd = self._process.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise _WorkerDied(f"its worker died (exit status {self._process.wait()})")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return json.loads(line)

    def _start(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tasks.sandbox.budget", self.name, json.dumps(self.kwargs)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,  # raw pipes: requests go out as written, answers are read from the pipe itself
        )
        self._pending = b""
        try:
            ready = self._answer(_START_S)
        except _WorkerDied as err:
            self.close()
            raise RuntimeError(f"the {self.name} verifier's worker did not start: {err}") from None
        if ready != ["ready", None]:
            self.close()
            raise RuntimeError(f"the {self.name} verifier's worker did not start within {_START_S:g} s")

    def __call__(self, response_text: str, label: str, *, truncated: bool) -> Verdict:
        return self.many([(response_text, label, truncated)])[0]

    def many(self, requests: Sequence[tuple[str, str, bool]]) -> list[Verdict]:
        """The verdicts of (response_text, label, truncated) requests, in order, each answer within
        `budget_s` of the one before it."""
        verdicts: list[Verdict] = []
        while len(verdicts) < len(requests):
            verdicts.extend(self._pipelined(requests[len(verdicts) :]))
        return verdicts

    def _pipelined(self, requests: Sequence[tuple[str, str, bool]]) -> list[Verdict]:
        """Send every request, read the answers in order; stops early after an overrun, whose
        verdict is the last one returned (the worker that overran is gone)."""
        if self._process is None:
            self._start()
        assert self._process is not None and self._process.stdin is not None
        lines = memoryview(b"".join(json.dumps([t, label, bool(cut)]).encode() + b"\n" for t, label, cut in requests))
        fd = self._process.stdin.fileno()

        def feed() -> None:  # a thread: the pipe holds 64 KiB, the worker answers as it reads
            sent = 0
            try:
                while sent < len(lines):
                    sent += os.write(fd, lines[sent:])
            except BrokenPipeError:  # the worker was stopped (an overrun): the rest goes to the next one
                pass

        self._writer = threading.Thread(target=feed, name="verifier-requests", daemon=True)
        self._writer.start()
        verdicts: list[Verdict] = []
        try:
            for _ in requests:
                try:
                    answer = self._answer(self.budget_s)
                except _WorkerDied as died:  # on this answer: it scores 0, the rest go to a fresh worker
                    logger.warning("verifier %s: %s on an answer, which scores 0", self.name, died)
                    self.close()
                    verdicts.append(failure_verdict(str(died)))
                    return verdicts
                if answer is None:
                    logger.warning(
                        "verifier %s: an answer overran its %.3g s budget; its worker was stopped",
                        self.name,
                        self.budget_s,
                    )
                    self.close()
                    verdicts.append(overrun_verdict(self.budget_s))
                    return verdicts
                kind, payload = answer[0], answer[1]
                if kind == "label":  # the worker goes (below): requests after it are still queued there
                    raise ValueError(payload)
                if kind == "failed":
                    logger.warning("verifier %s failed on an answer, which scores 0:\n%s", self.name, answer[2])
                    verdicts.append(failure_verdict(payload))
                    continue
                reward, feedback, format_error, was_truncated = payload
                verdicts.append(
                    Verdict(reward=reward, feedback=feedback, format_error=format_error, truncated=was_truncated)
                )
        except BaseException:  # an interrupt too: stop the worker, or a writer blocked on its full pipe never ends
            self.close()
            raise
        finally:
            if self._writer is not None:  # close() has joined it when the worker was stopped
                self._writer.join()
                self._writer = None
        return verdicts

    def close(self) -> None:
        """Stop the worker (a later call starts a new one)."""
        if self._process is None:
            return
        self._process.kill()
        self._process.wait()
        if self._writer is not None:  # its write fails on the dead worker's pipe; then the pipe may close
            self._writer.join()
            self._writer = None
        for stream in (self._process.stdin, self._process.stdout):
            assert stream is not None
            stream.close()
        self._process = None


if __name__ == "__main__":
    _serve(sys.argv[1], json.loads(sys.argv[2]))
