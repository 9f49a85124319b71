"""Which stage failures Prefect retries (tasks/stages.py:retry_transient): what a second attempt can
cure (a dropped connection, a timeout, a work-pool stage whose flow run Crashed with its machine),
never a stage that raised or a process that exited with an error."""

from __future__ import annotations

import pytest
from prefect.states import Failed

from tasks.launch import StageInfrastructureLost, StageProcessError
from tasks.stages import retry_transient


@pytest.mark.parametrize(
    ("error", "retried"),
    [
        (ConnectionResetError("peer reset"), True),
        (TimeoutError("read timed out"), True),
        (StageInfrastructureLost("flow run lost/iter-0001/train Crashed: No heartbeat for 90 s"), True),
        (StageProcessError("stage train of iteration 1 exited with 1"), False),
        (ValueError("rollout.top_k=0"), False),
    ],
)
def test_only_what_a_second_attempt_can_cure_is_retried(error: Exception, retried: bool) -> None:
    assert retry_transient(None, None, Failed(data=error)) is retried
