"""A per-answer time budget around the pure verifiers.

The verifiers are bounded by construction (linear parsing, depth, size and digit limits), and this
is the guarantee on top: each call runs in a worker process (started once, with only
`sdpo_core.verifiers` imported) and is given `budget_s` seconds. A call that overruns, whatever
it is stuck in (a regular expression, a C-level big-number operation, sympy), has its worker
killed and scores 0 with feedback saying so; the next call starts a fresh worker. So one answer
can never stall a rollout. A malformed label still raises (`ValueError` from the verifier, as
in-process), since that is a data error, not a verdict on the answer.

The code verifier is not run here: it is bounded by its sandbox's `total_s` (tasks/sandbox/program.py).
"""

from __future__ import annotations

import json
import logging
import select
import subprocess
import sys
from typing import Any

from sdpo_core.records import Verdict

__all__ = ["BudgetedVerifier", "overrun_verdict"]

logger = logging.getLogger(__name__)

_START_S = 60.0  # a fresh worker's interpreter start and imports (not counted in the budget)


def overrun_verdict(budget_s: float) -> Verdict:
    return Verdict(
        reward=0.0,
        feedback=f"The answer could not be checked within {budget_s:g} seconds; give a shorter, plainer final answer.",
    )


def _serve(name: str, kwargs: dict[str, Any]) -> None:
    """The worker: one JSON request per line on stdin, one JSON answer per line on stdout."""
    from sdpo_core.verifiers import VERIFIERS

    verifier = VERIFIERS[name]
    out = sys.stdout
    out.write(json.dumps(["ready", None]) + "\n")
    out.flush()
    for line in sys.stdin:
        text, label, truncated = json.loads(line)
        try:
            verdict = verifier(text, label, truncated=truncated, **kwargs)
        except ValueError as err:  # a malformed label: re-raised in the caller
            answer: list[Any] = ["label", str(err)]
        else:
            answer = ["ok", [verdict.reward, verdict.feedback, verdict.format_error, verdict.truncated]]
        out.write(json.dumps(answer) + "\n")
        out.flush()


class BudgetedVerifier:
    """`verify(response_text, label, *, truncated)` of the verifier `name` with `kwargs`, each call
    limited to `budget_s` seconds of wall-clock time."""

    def __init__(self, name: str, kwargs: dict[str, Any], *, budget_s: float) -> None:
        if not budget_s > 0:
            raise ValueError(f"budget_s must be > 0, got {budget_s}")
        self.name, self.kwargs, self.budget_s = name, dict(kwargs), budget_s
        self._process: subprocess.Popen | None = None

    def _answer(self, timeout: float) -> list[Any] | None:
        """The worker's next answer line, or None when none came within `timeout` seconds."""
        assert self._process is not None and self._process.stdout is not None
        ready, _, _ = select.select([self._process.stdout], [], [], timeout)
        if not ready:
            return None
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} verifier's worker died (exit status {self._process.wait()})")
        return json.loads(line)

    def _start(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tasks.sandbox.budget", self.name, json.dumps(self.kwargs)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            encoding="utf-8",
        )
        if self._answer(_START_S) != ["ready", None]:
            self.close()
            raise RuntimeError(f"the {self.name} verifier's worker did not start within {_START_S:g} s")

    def __call__(self, response_text: str, label: str, *, truncated: bool) -> Verdict:
        if self._process is None:
            self._start()
        assert self._process is not None and self._process.stdin is not None
        self._process.stdin.write(json.dumps([response_text, label, truncated]) + "\n")
        self._process.stdin.flush()
        answer = self._answer(self.budget_s)
        if answer is None:
            logger.warning(
                "verifier %s: an answer overran its %.3g s budget; its worker was stopped", self.name, self.budget_s
            )
            self.close()
            return overrun_verdict(self.budget_s)
        kind, payload = answer
        if kind == "label":
            raise ValueError(payload)
        reward, feedback, format_error, was_truncated = payload
        return Verdict(reward=reward, feedback=feedback, format_error=format_error, truncated=was_truncated)

    def close(self) -> None:
        """Stop the worker (a later call starts a new one)."""
        if self._process is None:
            return
        self._process.kill()
        self._process.wait()
        for stream in (self._process.stdin, self._process.stdout):
            assert stream is not None
            stream.close()
        self._process = None


if __name__ == "__main__":
    _serve(sys.argv[1], json.loads(sys.argv[2]))
