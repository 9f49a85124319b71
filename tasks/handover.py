"""Pipelined commits: a train stage's weights reach the next iteration's stages in memory, before
the store holds them.

When the train stage runs in the flow's process (`launch.overlap_commits`, the default with
in-process launchers), the flow starts iteration n+1's rollout and teacher prefill as soon as
train(n) has stepped the optimizer: the train stage offers the policy's weights (and the EMA
teacher's) here, the next stages copy them into their engine and scorer, and train(n) goes on
writing, hashing and uploading its checkpoints and its stage manifest, then commit(n) writes the
iteration manifest and LATEST, all while iteration n+1 samples and scores.

The store stays the only truth:
- no stage of iteration n+1 writes its manifest before iteration n is committed
  (`HandedCheckpoint.manifest` waits for it), so LATEST never names an iteration whose parents
  are not committed, and a restart after a kill anywhere finds only what a sequential run could
  have left (the next stage's shards without their manifest are redone);
- the weights handed over are the tensors the train stage's writers serialise, and the manifest a
  consumer names as its parent must list the digest those writers took (checked);
- nothing here outlives the process: a restart reads the store.

One `Slot` per (run, iteration), opened by the flow before it submits the train stage; consumers
that find none read the stored checkpoint as before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from storage.manifest import Manifest
    from tasks.runtime import Run

__all__ = ["HandedCheckpoint", "Slot", "close", "committed", "offer", "open_checkpoint", "open_slot", "slot"]

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
_SLOTS: dict[tuple[str, int], Slot] = {}


@dataclass
class Slot:
    """Iteration n's hand-over: its weights once trained (`offered`), its commit once written."""

    run_url: str
    iteration: int
    offered: Future[dict[str, Mapping[str, Any]]] = field(default_factory=Future)  # kind -> tensors
    digests: dict[str, Future[str]] = field(default_factory=dict)  # kind -> sha256 its writer took
    done: Future[None] = field(default_factory=Future)  # iteration n committed (or failed)

    def digest(self, kind: str) -> Future[str]:
        """The sha256 the writer of checkpoint `kind` takes (a future made by whoever asks first:
        a writer may finish before the tensors are offered)."""
        with _LOCK:
            return self.digests.setdefault(kind, Future())

    def weights(self, kind: str) -> Mapping[str, Any] | None:
        """The tensors of checkpoint `kind`, waiting until the train stage offers them; None when the
        iteration committed without handing anything over (a train stage committed by an earlier
        attempt is adopted from the store). Raises what stopped the iteration."""
        waited: list[Future[Any]] = [self.offered, self.done]
        wait(waited, return_when=FIRST_COMPLETED)
        if not self.offered.done():
            self.done.result()  # raises what stopped the iteration
            return None
        offered = self.offered.result()
        if kind not in offered:
            raise KeyError(f"iteration {self.iteration} handed over {sorted(offered)}, not a {kind!r} checkpoint")
        return offered[kind]

    def fail(self, error: BaseException) -> None:
        """Iteration n will not commit in this process: every waiter gets `error`."""
        with _LOCK:
            futures: list[Future[Any]] = [self.offered, self.done, *self.digests.values()]
        for future in futures:
            if not future.done():
                future.set_exception(error)


def open_slot(run_url: str, iteration: int) -> Slot:
    """A slot for iteration `iteration` of the run, which the flow opens before it submits the train
    stage: the next stages wait on it instead of reading the store."""
    with _LOCK:
        if (run_url, iteration) in _SLOTS:
            raise RuntimeError(f"iteration {iteration} of {run_url} already has a hand-over slot")
        opened = _SLOTS[(run_url, iteration)] = Slot(run_url, iteration)
    return opened


def slot(run_url: str, iteration: int) -> Slot | None:
    """The open slot of iteration `iteration`, or None (its checkpoints are read from the store)."""
    with _LOCK:
        return _SLOTS.get((run_url, iteration))


def close(run_url: str, iteration: int) -> None:
    """Forget the slot (the iteration is committed, or the flow gives up on it)."""
    with _LOCK:
        _SLOTS.pop((run_url, iteration), None)


def offer(run_url: str, iteration: int, weights: Mapping[str, Mapping[str, Any]]) -> Slot | None:
    """The train stage of `iteration` hands over its checkpoints' tensors (kind -> HF-named tensors,
    which nothing changes until the iteration is committed); None when no slot waits for them."""
    opened = slot(run_url, iteration)
    if opened is None:
        return None
    opened.offered.set_result(dict(weights))
    logger.info("iteration %d: %s handed over in memory", iteration, " and ".join(sorted(weights)))
    return opened


def digest_taken(run_url: str, iteration: int, kind: str, sha256: str) -> None:
    """The writer of checkpoint `kind` serialised the handed-over tensors and hashed them as `sha256`."""
    opened = slot(run_url, iteration)
    if opened is not None:
        opened.digest(kind).set_result(sha256)


def committed(run_url: str, iteration: int, error: BaseException | None = None) -> None:
    """Iteration `iteration` is committed (or, with `error`, will not be): release its waiters."""
    opened = slot(run_url, iteration)
    if opened is None:
        return
    if error is not None:
        opened.fail(error)
    elif not opened.done.done():
        opened.done.set_result(None)


@dataclass(frozen=True)
class HandedCheckpoint:
    """What a stage reads of checkpoint `kind` of `iteration`: a folder with its config and
    tokenizer files, the tensors when they were handed over in memory (None: read the folder's
    weights, or the copy this process kept), and its manifest, which `manifest()` returns once the
    iteration is committed."""

    run: Run
    iteration: int
    kind: str
    folder: Path
    weights: Mapping[str, Any] | None
    stand_in: Manifest  # the manifest whose files `folder` holds (this checkpoint's once stored)
    pending: Slot | None

    @property
    def handed_over(self) -> bool:
        return self.pending is not None

    def manifest(self) -> Manifest:
        """The checkpoint's manifest, waiting for its iteration's commit when it was handed over,
        and checked to list the digest its writer took of the tensors this stage used."""
        if self.pending is None:
            return self.stand_in
        from storage.checkpoints import resolve_checkpoint
        from tasks.kept_weights import weights_digest

        self.pending.done.result()
        stored = resolve_checkpoint(self.run.layout, f"iter-{self.iteration}", self.kind)
        taken = self.pending.digest(self.kind).result()
        if weights_digest(stored) != taken:
            raise RuntimeError(
                f"checkpoint {self.kind} of iteration {self.iteration} lists weights {weights_digest(stored)[:12]}, "
                f"but the tensors handed over to this stage were written as {taken[:12]}: the store changed under the run"
            )
        return stored


def open_checkpoint(run: Run, iteration: int, kind: str) -> HandedCheckpoint:
    """Checkpoint `kind` of `iteration` for a stage of this process: handed over when its train
    stage runs here with a slot open (waiting for the tensors), else the stored one."""
    from storage.checkpoints import resolve_checkpoint
    from tasks.runtime import checkpoint_dir

    pending = slot(run.url, iteration)
    weights = None if pending is None else pending.weights(kind)
    if weights is None:
        folder = checkpoint_dir(run, iteration, kind)
        manifest = resolve_checkpoint(run.layout, f"iter-{iteration}", kind)
        return HandedCheckpoint(run, iteration, kind, folder, None, manifest, None)
    # every checkpoint of a run has the base model's config and tokenizer files: the last stored
    # policy stands in for them (committed: train(n) started after commit(n-1))
    folder = checkpoint_dir(run, iteration - 1, "policy")
    stand_in = resolve_checkpoint(run.layout, f"iter-{iteration - 1}", "policy")
    return HandedCheckpoint(run, iteration, kind, folder, weights, stand_in, pending)
