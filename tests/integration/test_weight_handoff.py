"""Weights between the stages of one process: the train stage's uploads become the local cache's
copies (moved, not copied back from the store), and the weights it stored reach the rollout engine,
the teacher's scoring model, the evaluation and the next EMA update from memory
(`tasks/kept_weights.py`); the stored checkpoints stay the truth, and a run in one process ends with
the weights of a run whose process state is dropped between iterations (test_exact_resume.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.runs import TINY, forget_process_state, write_config


def _record_weight_reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """Every read of weights from the store or from a local file, by the way it was read."""
    import safetensors.torch
    import transformers

    from storage import cache, objects
    from storage.objects import ObjectStore
    from tasks import train

    reads: dict[str, list[str]] = {"store": [], "from_pretrained": [], "load_file": [], "ema": [], "hashed": []}
    get_to_local, load_teacher_weights = ObjectStore.get_to_local, train.load_teacher_weights
    load_file = safetensors.torch.load_file
    from_pretrained = transformers.AutoModelForCausalLM.from_pretrained.__func__

    def recording_get(self, url, local_path):
        reads["store"].append(url)
        return get_to_local(self, url, local_path)

    def recording_ema(folder):
        reads["ema"].append(str(folder))
        return load_teacher_weights(folder)

    def recording_load_file(filename, *args, **kwargs):
        reads["load_file"].append(str(filename))
        return load_file(filename, *args, **kwargs)

    def recording_from_pretrained(cls, path, *args, **kwargs):
        reads["from_pretrained"].append(str(path))
        return from_pretrained(cls, path, *args, **kwargs)

    def recording_hash(hash_file):
        def hashing(path, *args):
            reads["hashed"].append(str(path))
            return hash_file(path, *args)

        return hashing

    for module, name in ((objects, "sha256_local_file"), (cache, "sha256_local_file"), (objects, "copy_hashing")):
        monkeypatch.setattr(module, name, recording_hash(getattr(module, name)))
    monkeypatch.setattr(ObjectStore, "get_to_local", recording_get)
    monkeypatch.setattr(train, "load_teacher_weights", recording_ema)
    monkeypatch.setattr(safetensors.torch, "load_file", recording_load_file)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(recording_from_pretrained))
    return reads


@pytest.mark.parametrize(
    ("teacher", "backend"),
    [
        ("ema", "embedded"),
        ("live", "embedded"),
        ("trust-region", "embedded"),
        ("ema", "megatron"),
        ("trust-region", "megatron"),
    ],
)
def test_one_process_reads_only_the_base_weights(tmp_path, prefect_server, monkeypatch, teacher, backend):
    from flows.run import sdpo_run
    from storage.checkpoints import resolve_checkpoint
    from storage.layout import RunLayout

    forget_process_state()
    reads = _record_weight_reads(monkeypatch)
    config = write_config(
        tmp_path, "handoff", base={**TINY, "iterations": 3}, teacher={"update": teacher, "backend": backend}
    )
    sdpo_run(str(config), [])

    weights = [url for url in reads["store"] if url.endswith("model.safetensors")]
    assert weights, "the base model's weights are read from the store once"
    assert all("/checkpoints/iter-0/" in url for url in weights), weights  # nothing an iteration trained
    # Every weights file read locally is the base model's cached copy: the rollout engine, the
    # teacher's scoring model(s) and the evaluation load each trained checkpoint from memory.
    base = Path(
        tmp_path / "cache" / resolve_checkpoint(RunLayout(str(tmp_path / "runs"), "handoff"), "iter-0", "policy").sha256
    )
    local = [
        p for p in reads["from_pretrained"] + reads["load_file"] if "/cache/bootstrap/" not in p
    ]  # the base, built
    assert local and all(Path(p).resolve().is_relative_to(base.resolve()) for p in local), local
    assert len(reads["ema"]) == (1 if teacher == "ema" else 0)  # the EMA starts from the base policy
    # The train stage hashes the weights it writes from memory as it writes them: no weights file of
    # a trained checkpoint is read to learn its digest, on upload or when the next stage checks it.
    hashed = [Path(p) for p in reads["hashed"] if Path(p).name.endswith(".safetensors") or "safetensors.tmp" in p]
    trained = [p for p in hashed if "/cache/bootstrap/" not in str(p) and "/checkpoints/iter-0/" not in str(p)]
    assert hashed and not trained, trained


def test_kept_weights_are_found_only_under_the_digest_they_were_stored_with():
    import torch

    from tasks import kept_weights

    kept_weights.forget()
    stored = {
        "checkpoint": "policy",
        "files": [{"name": "config.json", "sha256": "c"}, {"name": "model.safetensors", "sha256": "a" * 64}],
    }
    other = {"checkpoint": "policy", "files": [{"name": "model.safetensors", "sha256": "b" * 64}]}
    weights = {"w": torch.ones(2)}
    kept_weights.keep(stored, weights)
    with kept_weights.borrowed(other) as found:
        assert found is None  # another checkpoint's weights file
    with kept_weights.borrowed({**stored, "checkpoint": "teacher"}) as found:
        assert found is None  # kinds are kept apart
    with kept_weights.borrowed(stored) as found:
        assert found is weights
    assert kept_weights.take(other) is None
    assert kept_weights.take(stored) is weights
    with kept_weights.borrowed(stored) as found:
        assert found is None  # taken out: the taker may change it
    with pytest.raises(ValueError, match="kind"):
        kept_weights.keep({**stored, "checkpoint": "megatron"}, weights)
    with pytest.raises(ValueError, match="0 model.safetensors entries"):
        kept_weights.keep({"checkpoint": "policy", "files": [{"name": "config.json", "sha256": "c"}]}, weights)


@pytest.mark.parametrize("tied", [False, True])
def test_weights_copied_into_a_model_equal_a_fresh_load(tmp_path, tied):
    """`load_into` gives the model `from_pretrained` would build from the same file, tied or not."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tasks.kept_weights import load_into
    from tests.synthetic import tiny_qwen3_config

    config = tiny_qwen3_config(64)
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "a")
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path / "b")
    fresh = AutoModelForCausalLM.from_pretrained(tmp_path / "b", dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.float32).eval()
    stored = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert ("lm_head.weight" in stored) != tied
    load_into(model, stored)
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    with pytest.raises(ValueError, match="missing"):
        load_into(model, {k: v for k, v in stored.items() if "layers.1." not in k})


def test_a_new_process_trains_without_fetching_the_previous_policys_weights(tmp_path, prefect_server, monkeypatch):
    """The train stage names the previous policy's tokenizer in the policy it writes. A stage
    process that keeps no tokenizer (one a subprocess or work-pool launcher started) fetches that
    checkpoint's tokenizer files only, never its weights, and trains to the same policy."""
    import shutil

    from flows.run import sdpo_run
    from storage.checkpoints import resolve_checkpoint
    from storage.layout import RunLayout
    from tasks.launch import run_stage
    from tasks.tokenizers import tokenizer_file

    forget_process_state()
    config = write_config(tmp_path, "tokfiles", base={**TINY, "iterations": 2, "eval": {"every": 0}})
    sdpo_run(str(config), [])
    layout = RunLayout(str(tmp_path / "runs"), "tokfiles")
    trained = resolve_checkpoint(layout, 2, "policy").data["files"]
    layout.store.remove_file(layout.stage_manifest(2, "train"))  # the stage runs again, as after a crash

    forget_process_state()  # what a new process keeps: nothing
    shutil.rmtree(tmp_path / "cache")
    reads = _record_weight_reads(monkeypatch)
    run_stage("train", str(tmp_path / "runs"), "tokfiles", 2)

    previous = sorted(url.rsplit("/files/", 1)[1] for url in reads["store"] if "/checkpoints/iter-1/policy/" in url)
    names = sorted(e["name"] for e in resolve_checkpoint(layout, 1, "policy").data["files"])
    assert "model.safetensors" in names and "model.safetensors" not in previous, previous
    assert previous == [name for name in names if tokenizer_file(name)]  # tokenizer and configs, once each
    assert resolve_checkpoint(layout, 2, "policy").data["files"] == trained  # the same policy, bit for bit
