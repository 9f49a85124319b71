"""The teacher stage's scoring models, built once per process and refilled each iteration.

Which weights score an iteration changes every iteration (the EMA teacher, the behaviour policy),
but the architecture does not. The first teacher stage of a process builds its models from the
checkpoint folders; later ones copy the new checkpoint's weights into them: from memory when this
process's train stage kept them (`tasks.kept_weights`, matched by the sha256 the store lists),
else from the folder's weights file. A model is handed out only with the weights of the manifest it
was asked for; one whose copy failed halfway is built again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from tasks.handover import HandedCheckpoint
from tasks.runtime import Run

# HF scoring models by role ('teacher', 'reference'): (run URL, identity of the weights they hold, model)
_HF: dict[str, tuple[str, str, Any]] = {}
# the Megatron scorer: ((run URL, tensor parallel, fused kernels), identity of the teacher's weights,
# of the reference's or None, scorer); at most one (identities: `_identity`)
_MEGATRON: list[tuple[tuple[str, int, bool], str, str | None, Any]] = []


def _identity(checkpoint: HandedCheckpoint) -> str:
    """What a kept model holds when it holds `checkpoint`: its weights file's sha256 once stored,
    else the hand-over it came from (a checkpoint still being committed has no digest yet)."""
    from tasks import kept_weights

    if checkpoint.weights is not None:
        return f"handed-over:{checkpoint.iteration}:{checkpoint.kind}"
    return kept_weights.weights_digest(checkpoint.stand_in)


@contextlib.contextmanager
def _weights(checkpoint: HandedCheckpoint) -> Iterator[Any]:
    """The checkpoint's weights for the block: handed over, the copy this process kept, or its file's."""
    from safetensors.torch import load_file

    from tasks import kept_weights

    if checkpoint.weights is not None:
        yield checkpoint.weights
        return
    with kept_weights.borrowed(checkpoint.stand_in) as kept:
        yield kept if kept is not None else load_file(str(checkpoint.folder / kept_weights.WEIGHTS_FILE))


def hf_scorer(run: Run, role: str, checkpoint: HandedCheckpoint) -> Any:
    """An HF model (float32, eval) holding the weights of `checkpoint`: this process's model of
    that role with the weights copied in, or built from the checkpoint's folder."""
    import torch
    from transformers import AutoModelForCausalLM

    from tasks import kept_weights

    identity = _identity(checkpoint)
    entry = _HF.pop(role, None)  # back below once its weights are those of `checkpoint`
    if entry is None or entry[0] != run.url:
        model = AutoModelForCausalLM.from_pretrained(str(checkpoint.folder), dtype=torch.float32).eval()
        if checkpoint.weights is not None:  # the folder is a stand-in for the architecture
            kept_weights.load_into(model, checkpoint.weights)
    else:
        model = entry[2]
        if entry[1] != identity:
            with _weights(checkpoint) as weights:
                kept_weights.load_into(model, weights)
    _HF[role] = (run.url, identity, model)
    return model


def megatron_scorer(run: Run, teacher: HandedCheckpoint, reference: HandedCheckpoint | None) -> Any:
    """A `MegatronTeacherScorer` holding the teacher checkpoint and the trust-region reference if
    any: this process's scorer with the new weights copied in, or built from the folders (bf16 on a
    GPU, float32 on the CPU)."""
    import torch
    from transformers import AutoConfig

    from tasks import kept_weights
    from tasks.megatron.convert import load_hf_state_into_megatron
    from tasks.megatron.parallel import init_parallel
    from tasks.megatron.scorer import MegatronTeacherScorer

    cfg = run.cfg
    key = (run.url, cfg.train.tensor_parallel, cfg.train.fused_kernels)
    wanted = (_identity(teacher), None if reference is None else _identity(reference))
    entry = _MEGATRON.pop() if _MEGATRON else None  # back below once it holds these weights
    if entry is None or entry[0] != key or (entry[2] is None) != (reference is None):
        scorer = MegatronTeacherScorer.from_hf(
            teacher.folder,
            tensor_parallel=cfg.train.tensor_parallel,
            dtype=torch.bfloat16 if torch.cuda.is_available() else torch.float32,
            seed=cfg.seed,
            reference_dir=None if reference is None else reference.folder,
            fused_kernels=cfg.train.fused_kernels,
        )
        # what the folders held: the checkpoints' own weights, or a stand-in's for handed-over ones
        held = (
            kept_weights.weights_digest(teacher.stand_in),
            None if reference is None else kept_weights.weights_digest(reference.stand_in),
        )
    else:
        scorer, held = entry[3], (entry[1], entry[2])
        # the CPU compatibility patches are per thread; a stage may run on a new worker thread
        init_parallel(tensor_parallel=cfg.train.tensor_parallel, seed=cfg.seed)
    refills: list[tuple[HandedCheckpoint, Any, str | None, str | None]] = [(teacher, scorer.model, held[0], wanted[0])]
    if reference is not None:
        refills.append((reference, scorer.reference, held[1], wanted[1]))
    hf_config = None
    for checkpoint, model, had, wants in refills:
        if had != wants:
            hf_config = hf_config or AutoConfig.from_pretrained(str(teacher.folder))
            with _weights(checkpoint) as weights:
                load_hf_state_into_megatron(model, weights, hf_config, source=str(checkpoint.folder))
    _MEGATRON.append((key, wanted[0], wanted[1], scorer))
    return scorer


def forget() -> None:
    """Drop every kept scoring model (what a new process would not have)."""
    _HF.clear()
    _MEGATRON.clear()
