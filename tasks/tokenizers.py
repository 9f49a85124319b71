"""A checkpoint's tokenizer, loaded once per process for each set of tokenizer files.

Every checkpoint of a run carries the base model's tokenizer files, so the stages of one process
would otherwise build the same tokenizer from disk once per stage and iteration. A tokenizer is
kept under the sha256 of the checkpoint's files other than its weights (`tokenizer_file`), as its
manifest lists them: another set of files is another tokenizer.

A stage that needs a stored checkpoint's tokenizer but not its weights (the train stage names the
previous policy's tokenizer in the policy it writes) calls `stored_tokenizer`: the kept tokenizer,
or one built from the checkpoint's other files alone, fetched without the weights. A stage process
started by a subprocess or work-pool launcher keeps no tokenizer yet, and fetching a whole policy
for its tokenizer would move gigabytes of weights it never reads.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from storage.manifest import Manifest

_KEEP = 4  # distinct tokenizers kept per process (runs side by side in one process)
_LOCK = threading.Lock()
_TOKENIZERS: OrderedDict[tuple[tuple[str, str], ...], Any] = OrderedDict()
# weights and optimizer state, in the formats a checkpoint folder or a user's model folder may hold
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".distcp")


def tokenizer_file(name: str) -> bool:
    """Whether a checkpoint file (its name in the manifest) is one a tokenizer may read: a top-level
    file that is not weights (tokenizer files, the model and generation configs)."""
    return "/" not in name and not name.endswith(WEIGHT_SUFFIXES)


def _key(manifest: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((e["name"], e["sha256"]) for e in manifest["files"] if tokenizer_file(e["name"])))


def _kept(key: tuple[tuple[str, str], ...]) -> Any:
    """The tokenizer kept under `key`, or None (the caller holds `_LOCK`)."""
    tokenizer = _TOKENIZERS.get(key)
    if tokenizer is not None:
        _TOKENIZERS.move_to_end(key)
    return tokenizer


def checkpoint_tokenizer(folder: Path, manifest: Mapping[str, Any] | None) -> Any:
    """The tokenizer of the checkpoint in `folder`; with its manifest, the one this process already
    built from the same files."""
    from transformers import AutoTokenizer

    if manifest is None:
        return AutoTokenizer.from_pretrained(str(folder))
    key = _key(manifest)
    with _LOCK:
        tokenizer = _kept(key)
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(str(folder))
            _TOKENIZERS[key] = tokenizer
            while len(_TOKENIZERS) > _KEEP:
                _TOKENIZERS.popitem(last=False)
        return tokenizer


def stored_tokenizer(layout: Any, manifest: Manifest, *, cache_dir: str | os.PathLike[str], verify: bool = True) -> Any:
    """The tokenizer of the stored checkpoint whose manifest is `manifest` (in `layout`, a
    `storage.layout.RunLayout`): the one this process keeps for its files, else built from the
    checkpoint's `tokenizer_file`s, which are fetched into the cache without the weights."""
    from storage.cache import download_checkpoint_files

    with _LOCK:
        tokenizer = _kept(_key(manifest))
    if tokenizer is not None:
        return tokenizer
    folder = download_checkpoint_files(layout, manifest, include=tokenizer_file, cache_dir=cache_dir, verify=verify)
    return checkpoint_tokenizer(folder, manifest)


def forget() -> None:
    """Drop every kept tokenizer."""
    with _LOCK:
        _TOKENIZERS.clear()
