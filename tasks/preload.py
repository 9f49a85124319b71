"""The libraries a process's stages will import, imported ahead of the first stage and kept out of
the garbage collector's way.

torch, transformers, megatron-core and MLflow bring about a million Python objects (modules,
classes, functions) that live as long as the process. CPython's cyclic collector traverses every
tracked object on each collection of its oldest generation, and it starts one whenever the objects
that survived younger collections have grown by a quarter. So while those libraries are imported it
runs full collections over and over (11 of them, 2.3 s, in a one-iteration `sdpo run` of the
benchmark model on a 2-core machine), later ones every so often during the run, and one more when
the interpreter exits.

`import_frozen` imports with the collector paused, then moves every object alive into the
permanent generation (`gc.freeze`), which no collection traverses. `sdpo run` and `sdpo advance`
call it for the stages they keep in process (`stage_imports`) while Prefect's server starts; a
stage process (`sdpo stage`, started by the subprocess and torchrun launchers) for its own stage
(`imports_of`). `freeze_for_exit` does the same just before a process ends, so the interpreter's
last collections skip what the process built (about 2 s at the end of every `sdpo` process that
trained). What is frozen is never collected: cyclic garbage alive at that moment stays until the
process ends, as everything frozen would.
"""

from __future__ import annotations

import gc
import importlib
import logging
from typing import Any

logger = logging.getLogger(__name__)

# what a stage's body imports: the HF model code (embedded engine, default teacher scorer), or a
# Megatron model (training, the Megatron teacher scorer)
HF_MODEL = ("torch", "transformers.modeling_utils")
MEGATRON_MODEL = ("torch", "megatron.core", "megatron.core.optimizer", "megatron.core.distributed")


def imports_of(stage: str, cfg: Any) -> list[str]:
    """The modules stage `stage` of a run of `cfg` imports. Rollout and evaluation on SGLang only
    talk HTTP; on the embedded engine they load an HF model, as the default teacher scorer does."""
    if stage in ("rollout", "eval"):
        return list(HF_MODEL) if cfg.rollout.engine == "embedded" else []
    if stage == "teacher":
        return list(MEGATRON_MODEL if cfg.teacher.backend == "megatron" else HF_MODEL)
    if stage == "train":
        return list(MEGATRON_MODEL)
    return []  # prepare-base and commit copy files and manifests


def stage_imports(cfg: Any) -> list[str]:
    """The modules the stages that `cfg.launch` keeps in this process will import, in import order;
    a stage launched elsewhere imports nothing here."""
    here = [s for s in ("rollout", "teacher", "train", "eval") if getattr(cfg.launch, s).launcher == "inprocess"]
    if not cfg.eval.enabled:
        here = [s for s in here if s != "eval"]
    return list(dict.fromkeys(name for stage in here for name in imports_of(stage, cfg)))


def import_frozen(names: list[str]) -> None:
    """Import `names` with the cyclic collector paused, then freeze every object alive (see the
    module's docstring). The collector is running again afterwards if it was before."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for name in names:
            importlib.import_module(name)
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()
    logger.debug("imported %s; %d objects frozen", names, gc.get_freeze_count())


def freeze_for_exit() -> None:
    """Freeze every object alive, so that the interpreter's collections at exit skip them."""
    gc.freeze()
