"""Verifiers: pure functions from (response text, label) to a `Verdict` with reward and feedback.

Each verifier has the signature `verify(response_text, label, *, truncated, **kwargs) -> Verdict`;
`VERIFIERS` maps the names a run config uses to them. The code verifier runs nothing itself: the
rollout stage gives it the sandbox (`tasks.sandbox.program.verify_code`).
"""

from collections.abc import Callable

from sdpo_core.records import Verdict
from sdpo_core.verifiers import arithmetic, code, math, mcq, tooluse

__all__ = ["VERIFIERS", "Verifier", "arithmetic", "code", "math", "mcq", "tooluse"]

Verifier = Callable[..., Verdict]

VERIFIERS: dict[str, Verifier] = {
    "arithmetic": arithmetic.verify,
    "mcq": mcq.verify,
    "tooluse": tooluse.verify,
    "function_call": tooluse.verify_function_calls,
    "math": math.verify,
    "code": code.verify,
}
