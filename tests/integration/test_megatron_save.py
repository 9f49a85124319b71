"""The full training state is saved without spawning a process, and loads back exactly."""

from __future__ import annotations

import multiprocessing.context

import pytest
import torch

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def trainer_inputs(tmp_path_factory):
    from tests.synthetic import write_training_inputs

    hf, _, columns = write_training_inputs(tmp_path_factory.mktemp("save"))
    return hf, columns


def _trainer(hf):
    from tasks.config import build_config
    from tasks.megatron.trainer import MegatronTrainer

    cfg = build_config({"iterations": 2, "data": {"prompts_per_iteration": 4}, "rollout": {"group_size": 4}})
    return MegatronTrainer(cfg, hf)


def _state(trainer) -> dict[str, torch.Tensor]:
    weights = {f"w/{k}": v.detach().clone() for k, v in trainer.model.module.named_parameters()}
    moments = {
        f"adam/{i}/{k}": v.clone()
        for i, state in enumerate(trainer.optimizer.optimizer.state.values())
        for k, v in state.items()
        if torch.is_tensor(v)
    }
    return {**weights, **moments}


def test_a_save_spawns_no_process_and_loads_back_bit_identical(trainer_inputs, tmp_path, monkeypatch):
    """Megatron's save starts a spawned multiprocessing manager (a fresh interpreter that
    re-imports the caller's main module: seconds and hundreds of MB) unless the trainer gives it
    an in-process results queue; any spawn here fails the test."""

    def no_spawn(*args, **kwargs):
        raise AssertionError("the checkpoint save started a spawned process")

    monkeypatch.setattr(multiprocessing.context.SpawnContext, "Manager", no_spawn)
    monkeypatch.setattr(multiprocessing.context.SpawnContext, "Process", no_spawn)
    hf, columns = trainer_inputs
    trainer = _trainer(hf)
    trainer.train_iteration(columns, iteration=1)
    trainer.save_megatron(tmp_path / "state", iteration=1)
    saved = _state(trainer)
    assert any(k.startswith("adam/") for k in saved)

    resumed = _trainer(hf)
    resumed.load_megatron(tmp_path / "state")
    restored = _state(resumed)
    assert restored.keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(restored[name], value), name
    assert resumed.iteration == 1
    # and the next step from the loaded state is the step from the kept one
    trainer.train_iteration(columns, iteration=2)
    resumed.train_iteration(columns, iteration=2)
    after, after_resumed = _state(trainer), _state(resumed)
    for name, value in after.items():
        assert torch.equal(after_resumed[name], value), name


def test_two_saves_of_one_state_write_the_same_bytes(trainer_inputs, tmp_path):
    """Every file of the distributed checkpoint, `.metadata` included (torch's writer records the
    folder it saved to and a random save id there unless `patch_deterministic_checkpoint_metadata`
    keeps them out), is the same whichever folder it was saved to; and the state loads back."""
    from storage.hashing import sha256_local_file

    hf, columns = trainer_inputs
    trainer = _trainer(hf)
    trainer.train_iteration(columns, iteration=1)
    first, second = tmp_path / "a" / "state", tmp_path / "elsewhere" / "megatron"
    trainer.save_megatron(first, iteration=1)
    trainer.save_megatron(second, iteration=1)
    names = sorted(p.name for p in first.iterdir())
    assert ".metadata" in names and names == sorted(p.name for p in second.iterdir())
    differ = [n for n in names if sha256_local_file(first / n) != sha256_local_file(second / n)]
    assert differ == []
    resumed = _trainer(hf)
    resumed.load_megatron(second)
    assert all(torch.equal(v, _state(trainer)[k]) for k, v in _state(resumed).items())


def test_the_metadata_does_not_depend_on_the_order_the_bucket_writers_report(tmp_path):
    """The per-bucket writers report their results in the order they finish, which varies from
    save to save; `.metadata` is the same whatever that order."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    from tasks.megatron.compat import patch_deterministic_checkpoint_metadata

    patch_deterministic_checkpoint_metadata()
    results = [
        WriteResult(
            index=MetadataIndex(fqn=f"w{i % 3}", offset=torch.Size([i, 0]), index=None),
            size_in_bytes=4,
            storage_data=_StorageInfo(relative_path=f"__0_{i % 2}.distcp", offset=4 * i, length=4),
        )
        for i in range(6)
    ]
    written = []
    for k, order in enumerate([[results[:3], results[3:]], [results[5:1:-1], results[1::-1]]]):
        folder = tmp_path / str(k)
        folder.mkdir()
        FileSystemWriterAsync(folder).finish(Metadata(state_dict_metadata={}), order)
        written.append((folder / ".metadata").read_bytes())
    assert written[0] == written[1]
