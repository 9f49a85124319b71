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
from pathlib import Path
from typing import Any

from storage.manifest import Manifest
from tasks.runtime import Run

# HF scoring models by role ('teacher', 'reference'): (run URL, sha256 of the weights file they hold, model)
_HF: dict[str, tuple[str, str, Any]] = {}
# the Megatron scorer: ((run URL, tensor parallel, fused kernels), sha256 of the teacher's weights
# file, of the reference's or None, scorer); at most one
_MEGATRON: list[tuple[tuple[str, int, bool], str, str | None, Any]] = []


@contextlib.contextmanager
def _stored_weights(folder: Path, manifest: Manifest) -> Iterator[Any]:
    """The checkpoint's weights for the block: the copy this process kept, else its file's."""
    from safetensors.torch import load_file

    from tasks import kept_weights

    with kept_weights.borrowed(manifest) as kept:
        yield kept if kept is not None else load_file(str(folder / kept_weights.WEIGHTS_FILE))


def hf_scorer(run: Run, role: str, folder: Path, manifest: Manifest) -> Any:
    """An HF model (float32, eval) holding the weights of the checkpoint `manifest` names, stored in
    `folder`: this process's model of that role with the weights copied in, or built from the folder."""
    import torch
    from transformers import AutoModelForCausalLM

    from tasks import kept_weights

    digest = kept_weights.weights_digest(manifest)
    entry = _HF.pop(role, None)  # back below once its weights are those of `manifest`
    if entry is None or entry[0] != run.url:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    else:
        model = entry[2]
        if entry[1] != digest:
            with _stored_weights(folder, manifest) as weights:
                kept_weights.load_into(model, weights)
    _HF[role] = (run.url, digest, model)
    return model


def megatron_scorer(run: Run, teacher: tuple[Path, Manifest], reference: tuple[Path, Manifest] | None) -> Any:
    """A `MegatronTeacherScorer` holding the teacher checkpoint (folder, manifest) and the
    trust-region reference if any: this process's scorer with the new weights copied in, or built
    from the folders (bf16 on a GPU, float32 on the CPU)."""
    import torch
    from transformers import AutoConfig

    from tasks import kept_weights
    from tasks.megatron.convert import load_hf_state_into_megatron
    from tasks.megatron.parallel import init_parallel
    from tasks.megatron.scorer import MegatronTeacherScorer

    cfg = run.cfg
    key = (run.url, cfg.train.tensor_parallel, cfg.train.fused_kernels)
    digests = (
        kept_weights.weights_digest(teacher[1]),
        None if reference is None else kept_weights.weights_digest(reference[1]),
    )
    entry = _MEGATRON.pop() if _MEGATRON else None  # back below once it holds these weights
    if entry is None or entry[0] != key or (entry[2] is None) != (reference is None):
        scorer = MegatronTeacherScorer.from_hf(
            teacher[0],
            tensor_parallel=cfg.train.tensor_parallel,
            dtype=torch.bfloat16 if torch.cuda.is_available() else torch.float32,
            seed=cfg.seed,
            reference_dir=None if reference is None else reference[0],
            fused_kernels=cfg.train.fused_kernels,
        )
    else:
        scorer = entry[3]
        # the CPU compatibility patches are per thread; a stage may run on a new worker thread
        init_parallel(tensor_parallel=cfg.train.tensor_parallel, seed=cfg.seed)
        hf_config = AutoConfig.from_pretrained(str(teacher[0]))
        refills: list[tuple[tuple[Path, Manifest], Any, str | None, str | None]] = [
            (teacher, scorer.model, entry[1], digests[0])
        ]
        if reference is not None:
            refills.append((reference, scorer.reference, entry[2], digests[1]))
        for (folder, manifest), model, had, wants in refills:
            if had != wants:
                with _stored_weights(folder, manifest) as weights:
                    load_hf_state_into_megatron(model, weights, hf_config, source=str(folder))
    _MEGATRON.append((key, digests[0], digests[1], scorer))
    return scorer


def forget() -> None:
    """Drop every kept scoring model (what a new process would not have)."""
    _HF.clear()
    _MEGATRON.clear()
