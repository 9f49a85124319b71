"""A flow run started by the CLI (`sdpo run`, `sdpo advance`) stops when it is cancelled in Prefect.

A deployment's flow run is stopped by the worker that started it: cancelled in Prefect's UI (or with
`prefect flow-run cancel`), it goes to Cancelling and the worker ends its process. A flow run the CLI
runs in its own process against a server (PREFECT_API_URL) has no worker: Prefect's server sets it
Cancelling and nothing acts on it, so it trained on, and the server marked it Cancelled only when its
cancelling timeout ran out, minutes later.

`cancellable` (beneath `@flow`) watches such a flow run while its body runs: a thread reads the flow
run's state every `POLL_S` seconds, and once it is Cancelling (or Cancelled) sends the main thread
SIGTERM, which Prefect's flow engine turns into `TerminationSignal` wherever the body is. Everything
the body holds ends on the way out, as on Ctrl-C: a stage process's group is killed, a stage's flow
run on a work pool is cancelled, an in-process stage is interrupted, the run lock is released. The
body then returns a Cancelled state whose message starts with `CANCELLED` (`cancelled_in_prefect`
tells it from a flow run that stood aside). The task run it interrupted ends Crashed, "aborted by a
termination signal", as when a worker cancels a deployment's flow run; Prefect's lines on that
crash are left out of the output, since the cancel is what happened. What was committed
stays committed, and running the same command again resumes at the first stage without a manifest.

Only a flow run that no deployment started, running on the main thread (where Prefect's flow engine
installs its SIGTERM handler), is watched: a deployment's flow runs are their worker's to stop.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import signal
import threading
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from flows.orchestration import cancelled

logger = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")

POLL_S = 1.0  # how often the flow run's state is read
CANCELLED = "Cancelled in Prefect"


def cancelled_in_prefect(state: Any) -> bool:
    """Whether a flow run's final state is that of a run `cancellable` stopped."""
    return bool(state.is_cancelled() and state.message is not None and state.message.startswith(CANCELLED))


class _Watch:
    """The thread that reads the flow run's state and signals the main thread once it is being
    cancelled; `stop` ends it, after which it sends nothing."""

    def __init__(self, flow_run_id: Any) -> None:
        self.flow_run_id = flow_run_id
        self.requested = threading.Event()
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._main = threading.main_thread().ident
        # the thread reads the state with this context's Prefect settings (the server's address)
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._watch,), name="sdpo-cancel-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _watch(self) -> None:
        import httpx
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            while not self._stopped.wait(POLL_S):
                try:
                    state = client.read_flow_run(self.flow_run_id).state
                except httpx.HTTPError as err:  # the server out of reach a moment: the next poll asks again
                    logger.debug("reading the state of flow run %s failed: %s", self.flow_run_id, err)
                    continue
                if state is not None and (state.is_cancelling() or state.is_cancelled()):
                    with self._lock:
                        if self._stopped.is_set():
                            return
                        self.requested.set()
                        logger.debug("flow run %s is %s: stopping the run", self.flow_run_id, state.name)
                        assert self._main is not None
                        signal.pthread_kill(self._main, signal.SIGTERM)
                    return

    def stop(self) -> None:
        with self._lock:
            self._stopped.set()
        self._thread.join()


class _QuietCrash(logging.Filter):
    """Drops Prefect's lines on the crash of the task run a requested cancel interrupted."""

    LINES = ("Crash detected!", "Finished in state Crashed(")

    def __init__(self, watch: _Watch) -> None:
        super().__init__()
        self.watch = watch

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.watch.requested.is_set() and record.getMessage().startswith(self.LINES))


def cancellable(body: Callable[P, R]) -> Callable[P, R]:
    """A flow's body that stops, returning a Cancelled state, once its flow run is cancelled in
    Prefect (see the module doc). Put it beneath `@flow`."""

    @functools.wraps(body)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        from prefect.exceptions import TerminationSignal
        from prefect.runtime import deployment, flow_run
        from prefect.utilities.engine import is_prefect_sigterm_handler_installed

        if flow_run.id is None or deployment.id is not None or not is_prefect_sigterm_handler_installed():
            return body(*args, **kwargs)
        watch = _Watch(flow_run.id)
        quiet = _QuietCrash(watch)
        task_runs = logging.getLogger("prefect.task_runs")
        task_runs.addFilter(quiet)
        watch.start()
        try:
            try:
                return body(*args, **kwargs)
            finally:
                watch.stop()
        except TerminationSignal:
            if not watch.requested.is_set():
                raise  # a SIGTERM from elsewhere: Prefect's engine and the CLI end the process
            return cancelled(  # the flow's final state
                f"{CANCELLED}: the stage under way was stopped and the run lock released; the same "
                "command (or the next tick) resumes the run where it stopped"
            )
        finally:
            task_runs.removeFilter(quiet)

    return run
