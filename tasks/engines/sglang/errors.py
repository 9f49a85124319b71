"""The SGLang client's errors, and the internal failure that its retries absorb."""

from __future__ import annotations

__all__ = [
    "SGLangError",
    "SGLangLogprobError",
    "SGLangProtocolError",
    "SGLangRequestError",
    "SGLangUnavailableError",
    "SGLangWeightVersionError",
    "TransientFailure",
]


class SGLangError(RuntimeError):
    """Base class of the SGLang client's errors."""


class SGLangUnavailableError(SGLangError):
    """A server did not become healthy in time, or a request kept failing after all retries."""


class SGLangRequestError(SGLangError):
    """A server rejected a request (4xx, or a failed weight update); carries its message."""

    def __init__(self, *, method: str, url: str, status: int, message: str) -> None:
        super().__init__(f"{method} {url} -> HTTP {status}: {message}")
        self.status = status
        self.url = url
        self.server_message = message


class SGLangWeightVersionError(SGLangError):
    """A server reports weights other than the ones this engine loaded."""


class SGLangProtocolError(SGLangError):
    """An answer does not have the shape of SGLang's native API."""


class SGLangLogprobError(SGLangError):
    """A server returns log-probs of the processed (tempered) distribution instead of the raw one."""


class TransientFailure(Exception):
    """A failure worth retrying: a connection error, a timeout, a 5xx answer, an aborted request.

    Never leaves the client: its retries either succeed or end in `SGLangUnavailableError`.
    """
