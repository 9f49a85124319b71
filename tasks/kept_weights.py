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


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kept weights are of kind {KINDS}, got {kind!r}")


def keep(kind: str, manifest: Mapping[str, Any], weights: dict[str, Any]) -> None:
    """Keep `weights`, the tensors whose stored file `manifest` names, for the next stages of this
    process. The caller hands them over: nothing may change them afterwards."""
    _check_kind(kind)
    digest = weights_digest(manifest)
    with _LOCK:
        _KEPT[kind] = (digest, weights)
    logger.debug("keeping the %s weights %s in memory", kind, digest[:12])


@contextlib.contextmanager
def borrowed(kind: str, manifest: Mapping[str, Any]) -> Iterator[dict[str, Any] | None]:
    """The kept weights of the checkpoint `manifest` names, or None; copy them inside the block."""
    _check_kind(kind)
    digest = weights_digest(manifest)
    with _LOCK:
        entry = _KEPT.get(kind)
        yield entry[1] if entry is not None and entry[0] == digest else None


def take(kind: str, manifest: Mapping[str, Any]) -> dict[str, Any] | None:
    """Remove and return the kept weights of the checkpoint `manifest` names (None if not kept):
    the caller may then change them."""
    _check_kind(kind)
    digest = weights_digest(manifest)
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
    tied = {name for name in missing if _is_tied(model, name)}
    if unexpected or set(missing) - tied:
        raise ValueError(
            f"weights do not fit {type(model).__name__}: missing {sorted(set(missing) - tied)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )


def _is_tied(model: Any, name: str) -> bool:
    """Whether parameter `name` shares its storage with a parameter under another name."""
    params = dict(model.named_parameters(remove_duplicate=False))
    if name not in params:
        return False
    pointer = params[name].data_ptr()
    return any(other != name and p.data_ptr() == pointer for other, p in params.items())
