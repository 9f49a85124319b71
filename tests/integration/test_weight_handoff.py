"""Weights between the stages of one process: the train stage's uploads become the local cache's
copies (moved, not copied back from the store) and the EMA update starts from the teacher in memory;
the stored checkpoints stay the truth, and a run in one process ends with the weights of a run whose
process state is dropped between iterations (test_exact_resume.py)."""

from __future__ import annotations

from tests.integration.runs import TINY, write_config


def test_one_process_reads_no_trained_weights_back_from_the_store(tmp_path, prefect_server, monkeypatch):
    from flows.run import sdpo_run
    from storage.objects import ObjectStore
    from tasks import rollout, train
    from tasks.megatron import resume

    fetched: list[str] = []
    loaded: list[str] = []
    get_to_local, load_teacher_weights = ObjectStore.get_to_local, train.load_teacher_weights

    def recording_get(self, url, local_path):
        fetched.append(url)
        return get_to_local(self, url, local_path)

    def recording_load(folder):
        loaded.append(str(folder))
        return load_teacher_weights(folder)

    monkeypatch.setattr(ObjectStore, "get_to_local", recording_get)
    monkeypatch.setattr(train, "load_teacher_weights", recording_load)
    resume._TRAINERS.clear()
    rollout._ENGINES.clear()
    train._EMA_TEACHER.clear()
    config = write_config(tmp_path, "handoff", base={**TINY, "iterations": 3}, teacher={"update": "ema"})
    sdpo_run(str(config), [])

    weights = [url for url in fetched if url.endswith("model.safetensors")]
    assert weights, "the base model's weights are read from the store once"
    assert all("/checkpoints/iter-0/" in url for url in weights), weights  # nothing an iteration trained
    assert len(loaded) == 1  # the EMA teacher read from disk once: the base policy, for iteration 1
