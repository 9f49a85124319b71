"""Pipelined commits on CUDA (flows/overlap.py): the next rollout samples from the policy handed
over in memory while the train stage's writers copy it to the host on a stream of their own, and
the weights it sampled from are, by digest, those committed for that iteration."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from tests.gpu.test_gpu_pipeline import SMALL

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REPO = Path(__file__).resolve().parents[2]


def test_the_rollout_samples_from_the_weights_committed_for_its_behaviour_iteration(
    tmp_path: Path, prefect_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import save

    import tasks.rollout
    from benchmarks.gpu.pipeline_run import write_policy
    from flows.run import sdpo_run
    from storage.checkpoints import resolve_checkpoint
    from storage.layout import RunLayout
    from tasks.kept_weights import weights_digest

    digests: dict[int, str] = {}
    sample_groups = tasks.rollout.sample_groups

    def recording(run, **kwargs):
        weights = kwargs.get("weights")
        if weights is not None:  # copied to the host the way the train stage's writer serialises them
            host = {k: v.detach().contiguous().cpu() for k, v in weights.items()}
            digests[kwargs["iteration"]] = hashlib.sha256(save(host, metadata={"format": "pt"})).hexdigest()
        return sample_groups(run, **kwargs)

    monkeypatch.setattr(tasks.rollout, "sample_groups", recording)
    model = write_policy("tiny-gpu", tmp_path / "model", vocab=1024)
    overrides = [
        *SMALL,
        f"model.path={model}",
        f"storage.root={tmp_path / 'runs'}",
        f"storage.cache_dir={tmp_path / 'cache'}",
        f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
        "name=handover",
        "iterations=3",
        "train.megatron_checkpoint_every=1",
    ]
    sdpo_run(str(REPO / "benchmarks/gpu/pipeline.yaml"), overrides)
    layout = RunLayout(str(tmp_path / "runs"), "handover")
    assert sorted(digests) == [2, 3]  # iterations 1 and 2 handed their policies over
    for n, digest in digests.items():
        assert digest == weights_digest(resolve_checkpoint(layout, f"iter-{n - 1}", "policy")), n
    # the full states of iterations 1 and 2 were saved in the background and named by the next stage
    from storage.checkpoints import lineage

    megatron = {r.iteration: r.committed for r in lineage(layout) if r.kind == "megatron"}
    assert megatron == {1: True, 2: True, 3: True}
