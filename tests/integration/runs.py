"""Tiny run configs and run fingerprints shared by the pipeline and restart tests.

A fingerprint is what an interrupted run must share with an uninterrupted one: LATEST, every
committed file's sha256 (shards, every checkpoint file, eval metrics), the set of files in the run
folder, the lineage, and the final policy's sha256. Manifests themselves differ between two runs
by their wall-clock fields (docs/reliability.md), so their own digests are not part of it.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

TINY: dict[str, Any] = {
    "seed": 3,
    "iterations": 2,
    "model": {
        "bootstrap": {
            "hidden_size": 32,
            "num_layers": 2,
            "num_heads": 4,
            "num_kv_heads": 2,
            "intermediate_size": 64,
            "max_positions": 128,
            "warmup_steps": 4,
            "warmup_batch_size": 8,
        }
    },
    "data": {"max_operand": 20, "prompts_per_iteration": 4, "eval_prompts": 6},
    "rollout": {"group_size": 4, "max_new_tokens": 4, "top_k": 8},
    "train": {"steps_per_iteration": 2, "micro_batch_size": 3},
    "optimizer": {"lr": 1.0e-3},
    "eval": {"every": 1, "sampled_n": 2},
}


def forget_process_state() -> None:
    """Drop what a new process would not have: the trainer, the rollout engines, the teacher's
    scoring models, and the weights and tokenizers kept between stages."""
    from tasks import kept_weights, rollout, scoring_models, tokenizers
    from tasks.megatron import resume

    resume._TRAINERS.clear()
    rollout._ENGINES.clear()
    scoring_models.forget()
    kept_weights.forget()
    tokenizers.forget()


def sdpo_here(args: Sequence[str], env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """`sdpo ARGS` inside this process (under `env`, as a process of its own would have it), for a
    command that only reads the store (`sdpo verify`): a process of its own would add its imports,
    not a check. An exception other than the command's exit is raised."""
    from typer.testing import CliRunner

    from flows.cli import app

    # the fault and key settings a test sets for its child processes are not this command's
    unset = {k: None for k in ("SDPO_SIGNING_KEY", "SDPO_CRASH_AT") if env is None or k not in env}
    done = CliRunner().invoke(app, list(args), env={**(env or {}), **unset})
    if done.exception is not None and not isinstance(done.exception, SystemExit):
        raise done.exception
    return subprocess.CompletedProcess(["sdpo", *args], done.exit_code, done.stdout, done.stderr)


def write_config(tmp_path: Path, name: str, root: str | None = None, *, base: dict | None = None, **sections) -> Path:
    """`<tmp_path>/<name>.yaml`: the tiny config (or `base`) named `name`, runs under `root`."""
    tree = json.loads(json.dumps(base or TINY))
    tree["name"] = name
    tree["storage"] = {"root": root or str(tmp_path / "runs"), "cache_dir": str(tmp_path / "cache")}
    # models are logged by the pipeline test that checks them; elsewhere they would only cost time
    tree["tracking"] = {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "log_model": False}
    for section, values in sections.items():
        if isinstance(values, dict):
            tree.setdefault(section, {}).update(values)
        else:
            tree[section] = values
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def final_policy_sha(layout: Any) -> str:
    """sha256 of the final policy's weights (model.safetensors of the LATEST policy checkpoint)."""
    from storage.checkpoints import resolve_checkpoint

    files = resolve_checkpoint(layout, "latest", "policy").data["files"]
    return next(f["sha256"] for f in files if f["name"] == "model.safetensors")


def fingerprint(layout: Any) -> dict[str, Any]:
    """What must not depend on how often or where the run was interrupted (see the module doc)."""
    from storage.checkpoints import lineage
    from storage.layout import CHECKPOINT_KINDS, STAGES
    from storage.manifest import read_latest, read_manifest
    from storage.stages import read_eval

    digests: dict[str, str] = {}
    evals: dict[int, dict[str, float]] = {}
    for n in layout.iterations():
        for stage in STAGES:
            url = layout.stage_manifest(n, stage)
            if layout.store.exists(url):
                digests.update({f["path"]: f["sha256"] for f in read_manifest(layout, url).data["files"]})
        if (metrics := read_eval(layout, n)) is not None:  # timings aside, the evaluation must agree
            evals[n] = {k: v for k, v in metrics.items() if not k.endswith("seconds")}
    for n in layout.checkpoint_iterations():
        for kind in CHECKPOINT_KINDS:
            url = layout.checkpoint_manifest(n, kind)
            if layout.store.exists(url):
                digests.update({f["path"]: f["sha256"] for f in read_manifest(layout, url).data["files"]})
    files = sorted(layout.relative(u) for u in layout.store.list_files(layout.run_url))
    return {
        "latest": read_latest(layout),
        "final_policy": final_policy_sha(layout),
        "digests": digests,
        "evals": evals,
        "files": [f for f in files if f != "LOCK"],
        "lineage": [
            (r.iteration, r.kind, r.parent_ok, r.trained_on_ok, r.committed, len(r.trained_on)) for r in lineage(layout)
        ],
    }


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Readable differences between two fingerprints (empty when they agree)."""
    out = [f"{key}: {a[key]!r} != {b[key]!r}" for key in a if key not in ("digests", "files") and a[key] != b[key]]
    for path in sorted(set(a["digests"]) | set(b["digests"])):
        if a["digests"].get(path) != b["digests"].get(path):
            out.append(f"{path}: {a['digests'].get(path)} != {b['digests'].get(path)}")
    out += [f"file only in one run: {f}" for f in sorted(set(a["files"]) ^ set(b["files"]))]
    return out


def assert_same_rollout(expected: Any, got: Any, n: int) -> int:
    """Iteration n's rollout shards of two runs (layouts) hold the same rows; returns the row count.

    Tokens, finish reasons and rewards must be equal; top-K log-probs equal within 1e-5 (an SGLang
    answer carries them through JSON).
    """
    import numpy as np

    from storage.shard_reader import read_stage_columns

    a = read_stage_columns(expected, n, "rollout")
    b = read_stage_columns(got, n, "rollout")
    assert list(a) == list(b)  # same schema, same column order
    assert [list(x) for x in a["response_ids"]] == [list(x) for x in b["response_ids"]]
    assert list(a["finish_reason"]) == list(b["finish_reason"])
    for x, y in zip(a["topk_logprobs"], b["topk_logprobs"], strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(a["reward"]), np.asarray(b["reward"]))
    return len(a["response_ids"])


def start_stage_worker(
    tmp_path: Path, prefect_server: str, *, start: bool = True, **worker_env: str
) -> tuple[str, Any]:
    """A process work pool on the test server with the `sdpo-stage` deployment of flows/stage.py, and a
    real `prefect worker` polling it every second (its output in tmp_path/worker.log, a session of its
    own). Returns the deployment's name and the worker's Popen (None with `start=False`: a pool that
    no worker serves); the caller kills its process group."""
    import os
    import subprocess
    import sys

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    from flows.stage import sdpo_stage

    repo = Path(__file__).resolve().parents[2]
    pool = f"stages-{tmp_path.name[-12:]}".replace("_", "-")
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
    sdpo_stage.from_source(source=str(repo), entrypoint="flows/stage.py:sdpo_stage").deploy(
        name=pool, work_pool_name=pool, print_next_steps=False
    )
    if not start:
        return f"sdpo-stage/{pool}", None
    env = dict(os.environ, PREFECT_API_URL=prefect_server, PREFECT_WORKER_QUERY_SECONDS="1", OMP_NUM_THREADS="1")
    # The flow run's INFO lines name it: a WARNING level left in os.environ by a CLI test that ran
    # earlier in this process would hide them from the worker's log.
    with (tmp_path / "worker.log").open("w") as sink:
        worker = subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--limit", "1"],
            cwd=repo,
            env={**env, "PYTHONUNBUFFERED": "1", "PREFECT_LOGGING_LEVEL": "INFO", **worker_env},
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return f"sdpo-stage/{pool}", worker
