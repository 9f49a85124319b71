"""Exact resume: a run advanced one iteration per process ends with the weights of one process.

`sdpo_advance` with the process's trainer and engines dropped between calls stands for the
scheduled deployment's one-process-per-iteration path (a real process per iteration is in the
fault suite); the optimizer, schedule, RNG and teacher state must all come back from the store.
"""

from __future__ import annotations

import pytest

from tests.integration.runs import TINY, differences, fingerprint, forget_process_state, write_config

THREE = {**TINY, "iterations": 3, "eval": {"every": 2, "sampled_n": 2}}


@pytest.mark.parametrize(
    ("loss", "teacher", "train"),
    [
        ("sdpo", "ema", {}),
        ("sdpo", "static", {}),
        ("sdpo", "live", {}),
        ("sdpo", "trust-region", {}),
        ("grpo", "static", {}),
        ("blend", "ema", {}),
        ("srpo", "ema", {}),
        ("sdpo", "ema", {"megatron_checkpoint_every": 2}),  # resume replays iteration 1 from its shards
    ],
    ids=[
        "sdpo-ema",
        "sdpo-static",
        "sdpo-live",
        "sdpo-trust-region",
        "grpo",
        "blend-ema",
        "srpo-ema",
        "sdpo-ema-replay",
    ],
)
def test_one_process_per_iteration_ends_bit_identical(tmp_path, prefect_server, loss, teacher, train):
    from flows.iteration import sdpo_advance
    from flows.run import sdpo_run
    from storage.layout import RunLayout

    sections = {
        "loss": {"type": loss, **({"blend_lambda": 0.5} if loss == "blend" else {})},
        "teacher": {"update": teacher},
        "train": {**THREE["train"], **train},
    }
    whole = write_config(tmp_path / "a", "exact", root=str(tmp_path / "a" / "runs"), base=THREE, **sections)
    stepped = write_config(tmp_path / "b", "exact", root=str(tmp_path / "b" / "runs"), base=THREE, **sections)
    forget_process_state()
    sdpo_run(str(whole), [])
    for _ in range(THREE["iterations"] + 1):
        forget_process_state()
        sdpo_advance(str(stepped), [])
    a = fingerprint(RunLayout(str(tmp_path / "a" / "runs"), "exact"))
    b = fingerprint(RunLayout(str(tmp_path / "b" / "runs"), "exact"))
    assert b["latest"] == a["latest"] == 3
    assert b["final_policy"] == a["final_policy"]
    assert differences(a, b) == []


TEN = {
    **TINY,
    "iterations": 10,
    "data": {**TINY["data"], "prompts_per_iteration": 2, "eval_prompts": 4},
    "eval": {"every": 4, "sampled_n": 1},
}
RETENTION = {"resumable": {"last": 2}, "weights": {"last": 2, "every": 5, "best": "eval/greedy_accuracy"}}


def test_retention_keeps_what_it_promises_across_a_run_and_a_resume(tmp_path, prefect_server):
    from typer.testing import CliRunner

    from flows.cli import app
    from flows.iteration import sdpo_advance
    from flows.run import sdpo_run
    from storage.layout import RunLayout
    from storage.retention import is_pruned
    from storage.stages import read_eval

    sections = {"storage": {"retention": RETENTION}}
    whole = write_config(tmp_path / "a", "kept", root=str(tmp_path / "a" / "runs"), base=TEN, **sections)
    stepped = write_config(tmp_path / "b", "kept", root=str(tmp_path / "b" / "runs"), base=TEN, **sections)
    forget_process_state()
    sdpo_run(str(whole), [])
    for _ in range(7):  # iterations 0..6 one process each, then the rest in one: a resume on pruned storage
        forget_process_state()
        sdpo_advance(str(stepped), [])
    forget_process_state()
    sdpo_run(str(stepped), [])

    a, b = RunLayout(str(tmp_path / "a" / "runs"), "kept"), RunLayout(str(tmp_path / "b" / "runs"), "kept")
    assert differences(fingerprint(a), fingerprint(b)) == []
    evals = {n: read_eval(a, n)["eval/greedy_accuracy"] for n in (4, 8, 10)}
    best = max((value, n) for n, value in evals.items())[1]
    kept = {
        kind: [n for n in range(11) if not is_pruned(a, n, kind) and a.store.exists(a.checkpoint_manifest(n, kind))]
        for kind in ("policy", "teacher", "megatron")
    }
    assert kept["megatron"] == [9, 10]
    assert kept["policy"] == sorted({0, 5, 9, 10, best})
    assert kept["teacher"] == sorted({5, 9, 10, best} - {0})
    dry = CliRunner().invoke(app, ["gc", "kept", "--root", str(tmp_path / "a" / "runs"), "--dry-run"])
    assert dry.exit_code == 0 and "would free 0.0 MiB" in dry.output, dry.output
    verified = CliRunner().invoke(app, ["verify", "kept", "--root", str(tmp_path / "a" / "runs")])
    assert verified.exit_code == 0, verified.output


def test_an_advance_reads_back_only_the_steps_mlflow_lacks_until_the_one_that_ends_the_run(
    tmp_path, prefect_server, monkeypatch
):
    """A scheduled advance does not read every earlier iteration back from the store (a few requests
    each): a step MLflow holds with its sample table is done. A step whose table is missing is
    caught up; the advance that ends the run reads every step for the run's summary."""
    import flows.iteration
    from flows.iteration import sdpo_advance

    config = write_config(tmp_path, "skips", root=str(tmp_path / "runs"), base={**THREE, "iterations": 5})
    for _ in range(3):  # the base model's step and iterations 1..3
        forget_process_state()
        sdpo_advance(str(config), [])
    (table,) = tmp_path.rglob("samples/iter-0002.json")
    table.unlink()  # as if a killed process had logged step 2 but not its sample table

    completed: list[int] = []
    complete_iteration = flows.iteration.complete_iteration

    def recorded(run, tracker, n, *args):
        completed.append(n)
        return complete_iteration(run, tracker, n, *args)

    monkeypatch.setattr(flows.iteration, "complete_iteration", recorded)
    forget_process_state()
    sdpo_advance(str(config), [])
    assert completed == [2, 4]  # the missing table, then the next iteration
    assert table.is_file()
    completed.clear()
    forget_process_state()
    sdpo_advance(str(config), [])  # iteration 5 ends the run
    assert completed == [0, 1, 2, 3, 4, 5]
