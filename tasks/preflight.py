"""Checks that need more than the config itself, run before a run is created or resumed.

`sdpo run` and `sdpo validate` call `preflight(cfg)` after the config validated and before
anything is written or handed to Prefect or MLflow, so a bad setup fails without leaving a run
folder: the storage root must not be a file, prepared data must follow the schema
(tasks/data/schema.py) with a held-out set disjoint from training, and `rollout.top_k` must fit
the tokenizer's vocabulary (bootstrap tokenizer, local model folder, preset or a hub model in the hub
cache; a model at a remote URL, or a hub model still to download, is checked when the rollout stage
loads it), a hub model must be in the hub cache when HF_HUB_OFFLINE is set and, when it is not in
the cache, known to the hub (a hub that cannot be reached leaves it unchecked, said in one warning),
and `rollout.device=cuda` needs a visible CUDA device.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tasks.config import ConfigError, RunConfig

__all__ = ["preflight", "vocabulary_size"]

logger = logging.getLogger(__name__)


def _local(url: str) -> Path | None:
    from storage.urls import protocol

    return Path(url.removeprefix("file://")) if protocol(url) == "file" else None


def vocabulary_size(cfg: RunConfig) -> int | None:
    """Ids in the policy's tokenizer, or None where it is only known once downloaded."""
    if cfg.model.preset == "smollm2-135m-instruct":
        from tasks.data.smollm2 import materialise_smollm2

        folder: Path | None = materialise_smollm2(cfg.storage.cache_dir)
    elif cfg.model.path:
        from tasks.hub import hub_model, hub_snapshot

        hub = hub_model(cfg.model.path)
        folder = _local(cfg.model.path) if hub is None else hub_snapshot(hub, cache_only=True)
        if folder is None:
            return None
    else:
        from tasks.data.bootstrap_model import bootstrap_vocabulary_size

        return bootstrap_vocabulary_size()
    from transformers import AutoTokenizer

    assert folder is not None
    return len(AutoTokenizer.from_pretrained(str(folder)))


def _check_hub_model(path: str) -> None:
    """A hub model must be in the hub cache (ConfigError offline, naming it), else the hub must
    know it (ConfigError when it says it does not); one warning naming it as unchecked when the hub
    could not be asked (the rollout stage fetches it, and fails there if it cannot be had)."""
    from tasks.hub import check_on_hub, hub_model, hub_snapshot

    hub = hub_model(path)
    if hub is None or hub_snapshot(hub, cache_only=True) is not None:
        return
    unchecked = check_on_hub(hub)
    if unchecked is not None:
        logger.warning(
            "model.path=%r is unchecked: not in the hub cache and the hub could not say whether it exists (%s); "
            "the rollout stage downloads it and fails there if it cannot (HF_HUB_OFFLINE=1 checks the cache alone)",
            hub.url,
            unchecked,
        )


def preflight(cfg: RunConfig) -> None:
    """ConfigError (naming the field, and file:line for data) when the run cannot start as configured."""
    root = _local(cfg.storage.root)
    if root is not None and root.exists() and not root.is_dir():
        raise ConfigError(f"storage.root: {cfg.storage.root!r} is a file, not a folder; point it at a folder")
    if cfg.data.source == "prepared" or cfg.data.questions:
        from tasks.data.prompts import training_rows

        try:
            training_rows(cfg.data, seed=cfg.seed)
        except (ValueError, FileNotFoundError) as err:  # InvalidRowError names the file and line
            raise ConfigError(f"data (data.path / data.eval_path / data.questions): {err}") from None
    if cfg.model.path:
        _check_hub_model(cfg.model.path)
    if cfg.rollout.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                "rollout.device='cuda' but this machine has no CUDA device (torch.cuda.is_available() is False); "
                "set rollout.device=cpu (and rollout.dtype=float32) or run on a GPU machine"
            )
    if cfg.loss.divergence != "full":
        vocab = vocabulary_size(cfg)
        if vocab is not None and cfg.rollout.top_k > vocab:
            raise ConfigError(
                f"rollout.top_k={cfg.rollout.top_k} exceeds the tokenizer's vocabulary ({vocab} ids); "
                f"set rollout.top_k <= {vocab}"
            )
