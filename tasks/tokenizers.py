"""A checkpoint's tokenizer, loaded once per process for each set of tokenizer files.

Every checkpoint of a run carries the base model's tokenizer files, so the stages of one process
would otherwise build the same tokenizer from disk once per stage and iteration. A tokenizer is
kept under the sha256 of the checkpoint's files other than its weights, as its manifest lists them:
another set of files is another tokenizer.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tasks.kept_weights import WEIGHTS_FILE

_KEEP = 4  # distinct tokenizers kept per process (runs side by side in one process)
_LOCK = threading.Lock()
_TOKENIZERS: OrderedDict[tuple[tuple[str, str], ...], Any] = OrderedDict()


def checkpoint_tokenizer(folder: Path, manifest: Mapping[str, Any] | None) -> Any:
    """The tokenizer of the checkpoint in `folder`; with its manifest, the one this process already
    built from the same files."""
    from transformers import AutoTokenizer

    if manifest is None:
        return AutoTokenizer.from_pretrained(str(folder))
    key = tuple(sorted((e["name"], e["sha256"]) for e in manifest["files"] if e["name"] != WEIGHTS_FILE))
    with _LOCK:
        tokenizer = _TOKENIZERS.get(key)
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(str(folder))
            _TOKENIZERS[key] = tokenizer
            while len(_TOKENIZERS) > _KEEP:
                _TOKENIZERS.popitem(last=False)
        _TOKENIZERS.move_to_end(key)
        return tokenizer


def forget() -> None:
    """Drop every kept tokenizer."""
    with _LOCK:
        _TOKENIZERS.clear()
