"""Retry wrapper: transient errors retried with backoff, permanent ones raised at once."""

from __future__ import annotations

import errno
import socket

import botocore.exceptions
import pytest

from storage.retry import RetryPolicy, call_with_retry, is_transient

FAST = RetryPolicy(attempts=4, backoff_s=0.0, max_backoff_s=0.0)


def _client_error(code: str, status: int) -> botocore.exceptions.ClientError:
    return botocore.exceptions.ClientError(
        {"Error": {"Code": code, "Message": "x"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"
    )


def _as_s3fs_raises(error: BaseException) -> OSError:
    """s3fs turns botocore errors into OSError raised `from` the original."""
    try:
        raise OSError(errno.EBUSY, "translated") from error
    except OSError as exc:
        return exc


@pytest.mark.parametrize(
    "error, transient",
    [
        (_as_s3fs_raises(_client_error("ServiceUnavailable", 503)), True),
        (_as_s3fs_raises(_client_error("InternalError", 500)), True),
        (_as_s3fs_raises(_client_error("SlowDown", 503)), True),
        (_client_error("RequestTimeout", 400), True),
        (TimeoutError("read timed out"), True),
        (botocore.exceptions.ReadTimeoutError(endpoint_url="http://x"), True),
        (ConnectionResetError(), True),
        (_as_s3fs_raises(_client_error("AccessDenied", 403)), False),
        (_as_s3fs_raises(_client_error("PreconditionFailed", 412)), False),
        (FileNotFoundError("s3://b/k"), False),
        (FileExistsError("s3://b/k"), False),
        (ValueError("bug"), False),
    ],
)
def test_transient_errors_are_told_from_permanent_ones(error: BaseException, transient: bool) -> None:
    assert is_transient(error) is transient


def test_transient_failures_are_retried_until_success(caplog: pytest.LogCaptureFixture) -> None:
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise _as_s3fs_raises(_client_error("ServiceUnavailable", 503))
        return "ok"

    assert call_with_retry(flaky, policy=FAST, what="put s3://b/k") == "ok"
    assert len(calls) == 3
    assert caplog.text.count("put s3://b/k failed (attempt") == 2


def test_retries_stop_after_the_configured_attempts() -> None:
    calls = []

    def down() -> None:
        calls.append(1)
        raise TimeoutError("read timed out")

    with pytest.raises(socket.timeout):
        call_with_retry(down, policy=FAST, what="get")
    assert len(calls) == FAST.attempts


def test_permanent_errors_are_not_retried() -> None:
    calls = []

    def missing() -> None:
        calls.append(1)
        raise FileNotFoundError("s3://b/k")

    with pytest.raises(FileNotFoundError):
        call_with_retry(missing, policy=FAST, what="get")
    assert len(calls) == 1


def test_backoff_is_capped_exponential_with_jitter() -> None:
    policy = RetryPolicy(attempts=10, backoff_s=0.1, max_backoff_s=1.0)
    for attempt, base in [(1, 0.1), (2, 0.2), (3, 0.4), (8, 1.0)]:
        delays = [policy.delay(attempt) for _ in range(50)]
        assert all(0.5 * base <= d <= 1.5 * base for d in delays)


@pytest.mark.parametrize("kwargs", [{"attempts": 0}, {"backoff_s": -1.0}, {"backoff_s": 2.0, "max_backoff_s": 1.0}])
def test_policy_rejects_nonsense(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)
