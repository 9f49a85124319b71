"""Rollout stage: the policy answers this iteration's prompts in groups; the verifier scores them.

Output: `iter-<n>/rollout` shards (one row per answer) and the stage manifest, written last.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from sdpo_core.records import Verdict
from storage.manifest import Manifest
from tasks.config import RolloutConfig, RunConfig
from tasks.runtime import Run

logger = logging.getLogger(__name__)

_ENGINES: dict[tuple[str, str], Any] = {}
_VERIFIERS: dict[tuple[str, str, float], Any] = {}  # one budgeted verifier worker per configuration


def get_engine(
    rollout: RolloutConfig,
    policy_dir: Path,
    *,
    cache_key: str,
    policy: Manifest | None = None,
    weights: Mapping[str, Any] | None = None,
) -> Any:
    """The rollout engine holding `policy_dir`'s weights; one per run and process, reloaded in place
    (from memory when `policy`, the folder's checkpoint manifest, names weights this process kept;
    the evaluation also samples from a teacher checkpoint). `weights`: the tensors to sample with,
    handed over before the store holds them (`tasks.handover`); `policy_dir` then holds the
    architecture and tokenizer only."""
    from tasks import kept_weights

    if weights is not None and rollout.engine != "embedded":
        raise ValueError(
            f"rollout.engine={rollout.engine!r} loads checkpoints from folders: weights handed over in memory "
            "cannot reach its servers (pipelined commits need rollout.engine='embedded')"
        )
    key = (cache_key, rollout.engine)
    engine = _ENGINES.get(key)
    if engine is None:
        if rollout.engine == "embedded":
            import torch

            from tasks.engines.embedded import EmbeddedEngine

            dtype = torch.bfloat16 if rollout.dtype == "bfloat16" else torch.float32
            engine = EmbeddedEngine(
                str(policy_dir), device=rollout.device, dtype=dtype, max_batch_size=rollout.batch_size
            )
        else:
            from tasks.engines.sglang.client import SGLangEngine

            cfg = rollout.sglang
            engine = SGLangEngine(
                cfg,
                str(policy_dir),
                router_url=cfg.router_url,
                backoff_s=cfg.backoff_s,
                max_backoff_s=cfg.max_backoff_s,
                weight_update_timeout_s=cfg.weight_update_timeout_s,
                check_logprobs=cfg.check_logprobs,
            )
        _ENGINES[key] = engine
        if weights is not None:
            engine.load_weights(str(policy_dir), weights=weights)
    elif weights is not None:
        engine.load_weights(str(policy_dir), weights=weights)
    elif policy is None:
        engine.load_weights(str(policy_dir))
    else:
        with kept_weights.borrowed(policy) as weights:
            engine.load_weights(str(policy_dir), weights=weights)
    return engine


def render_prompt_ids(
    tokenizer: Any, conversations: list[list[dict[str, str]]], chat_template_kwargs: dict
) -> list[list[int]]:
    """Token ids of each conversation under the tokenizer's own chat template, ending in the
    assistant header. One batched call: transformers renders each conversation and encodes them
    all in one call of the fast tokenizer, which at 512 teacher contexts is 2-4x faster than a
    call per conversation, with the same ids."""
    if not conversations:
        return []
    out = tokenizer.apply_chat_template(
        [list(c) for c in conversations],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        **chat_template_kwargs,
    )
    return [[int(i) for i in ids] for ids in out["input_ids"]]


def effective_top_k(cfg: RunConfig, vocab_size: int) -> int:
    """K ids recorded per token: the configured top-K, or the whole vocabulary for `full`."""
    if cfg.loss.divergence == "full":
        return vocab_size
    if cfg.rollout.top_k > vocab_size:
        raise ValueError(f"rollout.top_k={cfg.rollout.top_k} exceeds the vocabulary ({vocab_size} ids)")
    return cfg.rollout.top_k


def verify_all(cfg: RunConfig, requests: list[tuple[str, str, bool]]) -> list[Verdict]:
    """The configured verifier's verdicts on (response_text, label, truncated) requests, in order;
    code runs in the sandbox (bounded by its `total_s`), every other verifier in a worker that gets
    `verifier.time_budget_s` per answer and takes the whole list in one pass (tasks/sandbox/budget.py).

    Every answer gets a verdict: a verifier that fails on one answer gives that answer 0 with the
    reason (logged with its traceback), never the batch. What stops the batch is not an answer's
    doing: a malformed label, or a sandbox that cannot run here (SandboxUnavailable)."""
    if cfg.verifier.name == "code":
        from sdpo_core.verifiers.code import parse_tests
        from tasks.sandbox.program import verify_code

        for _, label, _ in requests:
            parse_tests(label)  # a malformed label is a data error, raised before any answer runs
        return [
            _verify_code_answer(verify_code, text, label, cut, cfg.verifier.kwargs) for text, label, cut in requests
        ]
    from tasks.sandbox.budget import BudgetedVerifier

    key = (cfg.verifier.name, json.dumps(cfg.verifier.kwargs, sort_keys=True), cfg.verifier.time_budget_s)
    verifier = _VERIFIERS.get(key)
    if verifier is None:
        verifier = _VERIFIERS[key] = BudgetedVerifier(
            cfg.verifier.name, cfg.verifier.kwargs, budget_s=cfg.verifier.time_budget_s
        )
    return verifier.many(requests)


def _verify_code_answer(verify_code: Any, text: str, label: str, cut: bool, kwargs: dict[str, Any]) -> Verdict:
    from tasks.sandbox.budget import failure_verdict
    from tasks.sandbox.program import SandboxUnavailable

    try:
        return verify_code(text, label, truncated=cut, **kwargs)
    except SandboxUnavailable:
        raise
    except Exception as err:  # noqa: BLE001 -- the boundary that keeps one answer's failure its own
        logger.exception("the code verifier failed on an answer, which scores 0")
        return failure_verdict(f"{type(err).__name__}: {err}")


def sample_groups(
    run: Run,
    *,
    rows: list[dict[str, Any]],
    policy_dir: Path,
    n: int,
    temperature: float,
    top_p: float,
    seed: int,
    iteration: int,
    progress: bool = True,
    policy: Manifest | None = None,
    weights: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, float]]:
    """Sample `n` answers for each row and verify them. Returns (columns, metrics). `policy` is
    `policy_dir`'s checkpoint manifest: its weights come from memory when this process kept them;
    `weights`, tensors handed over in memory, are sampled with instead of the folder's."""
    from tasks.tokenizers import checkpoint_tokenizer

    cfg = run.cfg
    tokenizer = checkpoint_tokenizer(policy_dir, policy)
    engine = get_engine(cfg.rollout, policy_dir, cache_key=run.url, policy=policy, weights=weights)
    prompt_ids = render_prompt_ids(tokenizer, [r["prompt_messages"] for r in rows], cfg.model.chat_template_kwargs)
    k = effective_top_k(cfg, len(tokenizer))
    stop_ids = [int(tokenizer.eos_token_id)]

    started = time.perf_counter()
    generations = engine.generate(
        prompt_ids,
        n=n,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
        stop_token_ids=stop_ids,
        top_k_logprobs=k,
        seed=seed,
        progress=progress,
    )
    gen_seconds = time.perf_counter() - started

    answers = [
        (group_id, row, ids, gen)
        for group_id, (row, ids, group) in enumerate(zip(rows, prompt_ids, generations, strict=True))
        for gen in group
    ]
    texts = [tokenizer.decode(gen.response_ids, skip_special_tokens=True) for *_, gen in answers]
    # every answer judged in one pass through the verifier's worker
    requests = [
        (text, row["label"], gen.finish_reason == "length")
        for text, (_, row, _, gen) in zip(texts, answers, strict=True)
    ]
    verdicts = verify_all(cfg, requests)
    cols: dict[str, list[Any]] = {name: [] for name in _ROLLOUT_COLUMNS}
    for sample_id, (text, verdict, (group_id, row, ids, gen)) in enumerate(zip(texts, verdicts, answers, strict=True)):
        cols["sample_id"].append(sample_id)
        cols["group_id"].append(group_id)
        cols["iteration"].append(iteration)
        cols["prompt_id"].append(str(row["prompt_id"]))
        cols["prompt_messages"].append(row["prompt_messages"])
        cols["prompt_ids"].append(ids)
        cols["response_ids"].append(list(gen.response_ids))
        cols["response_text"].append(text)
        cols["sampled_logprobs"].append(np.asarray(gen.sampled_logprobs, dtype=np.float32))
        cols["topk_ids"].append(np.asarray(gen.topk_ids, dtype=np.int32))
        cols["topk_logprobs"].append(np.asarray(gen.topk_logprobs, dtype=np.float32))
        cols["finish_reason"].append(gen.finish_reason)
        cols["reward"].append(float(verdict.reward))
        cols["feedback"].append(verdict.feedback)
        cols["format_error"].append(bool(verdict.format_error))
        cols["label"].append(str(row["label"]))
        cols["data_source"].append(str(row["data_source"]))
        cols["teacher_prompt"].append(row.get("teacher_prompt"))
        cols["extra_json"].append(json.dumps(row.get("metadata", {}), sort_keys=True))

    rewards = np.asarray(cols["reward"], dtype=np.float64)
    lengths = np.asarray([len(r) for r in cols["response_ids"]], dtype=np.float64)
    tokens = float(lengths.sum())
    metrics = {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/accuracy": float((rewards >= 1.0).mean()),
        "rollout/response_length_mean": float(lengths.mean()),
        "rollout/truncated_fraction": float(np.mean([f == "length" for f in cols["finish_reason"]])),
        "rollout/format_error_fraction": float(np.mean(cols["format_error"])),
        "rollout/tokens": tokens,
        "rollout/seconds": gen_seconds,
        "rollout/tokens_per_second": tokens / max(gen_seconds, 1e-9),
    }
    return cols, metrics


_ROLLOUT_COLUMNS = (
    "sample_id",
    "group_id",
    "iteration",
    "prompt_id",
    "prompt_messages",
    "prompt_ids",
    "response_ids",
    "response_text",
    "sampled_logprobs",
    "topk_ids",
    "topk_logprobs",
    "finish_reason",
    "reward",
    "feedback",
    "format_error",
    "label",
    "data_source",
    "teacher_prompt",
    "extra_json",
)


def run_rollout(root: str, run_name: str, iteration: int) -> dict:
    """Rollout stage of `iteration`: returns its manifest (a committed one is checked, then reused)."""
    from storage.adopt import adopt_stage
    from storage.manifest import stage_done
    from storage.shard_writer import write_shards
    from tasks.data.prompts import iteration_prompts, training_rows
    from tasks.handover import open_checkpoint
    from tasks.runtime import behaviour_iteration, open_run

    run = open_run(root, run_name)
    cfg = run.cfg
    if stage_done(run.layout, iteration, "rollout"):
        # committed by an earlier attempt: checked against its digests before it is reused
        manifest = adopt_stage(run.layout, iteration, "rollout", hash_files=cfg.storage.verify_sha256)
        logger.info("iteration %d rollout already committed; checked, reusing it", iteration)
        return manifest
    from storage.faults import crash_point

    crash_point("stage.start:rollout", iteration)

    started = time.perf_counter()
    train_rows = training_rows(cfg.data, seed=cfg.seed)
    rows = iteration_prompts(
        train_rows, iteration=iteration, per_iteration=cfg.data.prompts_per_iteration, seed=cfg.seed
    )
    behaviour = behaviour_iteration(cfg, iteration)
    # handed over in memory while its iteration commits (tasks/handover.py), else the stored one
    policy = open_checkpoint(run, behaviour, "policy")
    columns, metrics = sample_groups(
        run,
        rows=rows,
        policy_dir=policy.folder,
        policy=policy.stand_in,
        weights=policy.weights,
        n=cfg.rollout.group_size,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        seed=cfg.seed * 1_000_003 + iteration,
        iteration=iteration,
    )
    metrics["rollout/behaviour_iteration"] = float(behaviour)
    metrics["rollout/staleness"] = float(iteration - 1 - behaviour)
    written = time.perf_counter()
    output = write_shards(run.layout, iteration, "rollout", columns, logprob_dtype=cfg.storage.logprob_dtype)
    metrics["rollout/write_seconds"] = time.perf_counter() - written
    metrics["rollout/stage_seconds"] = time.perf_counter() - started  # its shards written; the manifest holds it
    if policy.handed_over:
        crash_point("rollout.awaiting_parent_commit", iteration)
    waited = time.perf_counter()
    behaviour_policy = policy.manifest()  # the parent, once its iteration is committed
    metrics["rollout/parent_wait_seconds"] = time.perf_counter() - waited
    return output.commit(parents=[behaviour_policy], metrics=metrics)
