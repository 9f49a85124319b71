"""Verifiers: pure functions from (response text, label) to a `Verdict` with reward and feedback.

Each verifier has the signature `verify(response_text, label, *, truncated) -> Verdict`;
`VERIFIERS` maps the names a run config uses to them.
"""

from collections.abc import Callable

from sdpo_core.records import Verdict
from sdpo_core.verifiers import arithmetic

__all__ = ["VERIFIERS", "Verifier", "arithmetic"]

Verifier = Callable[..., Verdict]

VERIFIERS: dict[str, Verifier] = {"arithmetic": arithmetic.verify}
