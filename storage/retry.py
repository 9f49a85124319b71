"""Retries for transient object-store failures (5xx, throttling, timeouts, dropped connections).

botocore retries single HTTP requests as configured in `storage_options` (`config_kwargs`); this
wrapper retries whole store operations (a PUT, a GET, a listing) on what still escapes, with capped
exponential backoff and jitter. Permanent errors (missing object, failed precondition, access denied)
are raised at once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

# S3 error codes that mean "try again", whatever the HTTP status.
_TRANSIENT_CODES = frozenset(
    {
        "InternalError",
        "ServiceUnavailable",
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "ConditionalRequestConflict",
    }
)
_PERMANENT_OS_ERRORS = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a store operation is retried."""

    attempts: int = 5
    backoff_s: float = 0.2
    max_backoff_s: float = 5.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError(
                f"RetryPolicy needs 0 <= backoff_s <= max_backoff_s, got {self.backoff_s}, {self.max_backoff_s}"
            )

    def delay(self, attempt: int) -> float:
        """Sleep before retry number `attempt` (1-based): capped exponential with +-50 % jitter."""
        base = min(self.max_backoff_s, self.backoff_s * 2.0 ** (attempt - 1))
        return base * (0.5 + random.random())


def _exception_chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def is_transient(exc: BaseException) -> bool:
    """True when `exc` (or an exception it was raised from) is worth retrying."""
    import botocore.exceptions

    chain = _exception_chain(exc)
    if isinstance(chain[0], _PERMANENT_OS_ERRORS):
        return False
    for err in chain:
        if isinstance(err, botocore.exceptions.ClientError):
            error = err.response.get("Error", {})
            status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            return error.get("Code") in _TRANSIENT_CODES or status >= 500
        if isinstance(
            err,
            (
                botocore.exceptions.HTTPClientError,
                botocore.exceptions.ConnectionError,
                socket.timeout,
                TimeoutError,
                asyncio.TimeoutError,
                ConnectionError,
            ),
        ):
            return True
    return False


def call_with_retry(fn: Callable[[], T], *, policy: RetryPolicy, what: str) -> T:
    """Run `fn`, retrying transient failures per `policy`; `what` names the operation in logs."""
    for attempt in range(1, policy.attempts + 1):
        try:
            return fn()
        except Exception as exc:  # classified below; anything permanent is re-raised untouched
            if attempt == policy.attempts or not is_transient(exc):
                raise
            delay = policy.delay(attempt)
            logger.warning(
                "%s failed (attempt %d/%d): %s: %s; retrying in %.2fs",
                what,
                attempt,
                policy.attempts,
                type(exc).__name__,
                exc,
                delay,
            )
            time.sleep(delay)
    raise AssertionError("unreachable")
