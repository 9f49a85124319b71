"""Weights this process stored last, kept in memory under the sha256 of their stored weights file.

The train stage stores two checkpoints an iteration (the policy and, with `teacher.update: ema`, the
EMA teacher) and keeps what it wrote here; the next stages of the same process load that
checkpoint from memory when its manifest names the same digest, instead of reading the stored file
back: the rollout engine, the teacher scorer, the next EMA update. In any other case (another
process, a restart, a replaced checkpoint) nothing matches and the stored folder is read. A copy is
found only under the digest of the bytes stored from it, so the store stays the truth.

One entry per kind; keeping a newer one drops the older. Borrowers copy the tensors while they
hold the entry's lock (`borrowed`); the EMA update takes its entry out (`take`) before it updates
the tensors in place, so nobody copies a half-updated teacher.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping
from typing import Any

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
KINDS = ("policy", "teacher")

_LOCK = threading.Lock()
_KEPT: dict[str, tuple[str, dict[str, Any]]] = {}  # kind -> (sha256 of the stored weights file, tensors)


def weights_digest(manifest: Mapping[str, Any]) -> str:
    """The sha256 of a checkpoint manifest's weights file."""
    digests = [e["sha256"] for e in manifest["files"] if e["name"] == WEIGHTS_FILE]
    if len(digests) != 1:
        names = sorted(e["name"] for e in manifest["files"])
        raise ValueError(f"a checkpoint manifest lists {len(digests)} {WEIGHTS_FILE} entries; its files: {names}")
    return str(digests[0])


def _kind_and_digest(manifest: Mapping[str, Any]) -> tuple[str, str]:
    """(checkpoint kind, sha256 of its weights file) of a checkpoint manifest."""
    kind = str(manifest["checkpoint"])
    if kind not in KINDS:
        raise ValueError(f"kept weights are of kind {KINDS}, got a {kind!r} checkpoint")
    return kind, weights_digest(manifest)


def keep(manifest: Mapping[str, Any], weights: dict[str, Any]) -> None:
    """Keep `weights`, the tensors whose stored file the checkpoint `manifest` names, for the next
    stages of this process. The caller hands them over: nothing may change them afterwards."""
    kind, digest = _kind_and_digest(manifest)
    with _LOCK:
        _KEPT[kind] = (digest, weights)
    logger.debug("keeping the %s weights %s in memory", kind, digest[:12])


@contextlib.contextmanager
def borrowed(manifest: Mapping[str, Any]) -> Iterator[dict[str, Any] | None]:
    """The kept weights of the checkpoint `manifest` names, or None; copy them inside the block."""
    kind, digest = _kind_and_digest(manifest)
    with _LOCK:
        entry = _KEPT.get(kind)
        yield entry[1] if entry is not None and entry[0] == digest else None


def take(manifest: Mapping[str, Any]) -> dict[str, Any] | None:
    """Remove and return the kept weights of the checkpoint `manifest` names (None if not kept):
    the caller may then change them."""
    kind, digest = _kind_and_digest(manifest)
    with _LOCK:
        entry = _KEPT.get(kind)
        if entry is None or entry[0] != digest:
            return None
        del _KEPT[kind]
        return entry[1]


def forget() -> None:
    """Drop every kept copy (what a new process would not have)."""
    with _LOCK:
        _KEPT.clear()


def load_into(model: Any, weights: Mapping[str, Any]) -> None:
    """Copy a checkpoint's tensors into an HF model of its architecture (cast to the model's dtype
    and device, as `from_pretrained` would); the names must match the model's, tied weights aside."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # a tied parameter shares its storage with a parameter under another name, loaded through that one
    pointers: dict[int, int] = {}
    params = dict(model.named_parameters(remove_duplicate=False))
    for param in params.values():
        pointers[param.data_ptr()] = pointers.get(param.data_ptr(), 0) + 1
    untied = sorted(name for name in missing if name not in params or pointers[params[name].data_ptr()] < 2)
    if unexpected or untied:
        raise ValueError(
            f"weights do not fit {type(model).__name__}: missing {untied[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
