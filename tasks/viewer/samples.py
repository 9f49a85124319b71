"""One sample and one group as the viewer shows them, decoded with the policy's own tokenizer.

The prompt is the decoded `prompt_ids` (the chat template as the policy saw it); the response is
shown token by token with its credit, the student's and teacher's probabilities of the student's
top-K ids, the teacher's entropy and, for samples SRPO routed to SDPO, the entropy weight
(`tasks.viewer.data` says how it is normalised). The demonstration a sample's teacher saw is not a shard column; it is derived
with the run's feedback policy (`FeedbackPolicy.demonstrations`, the function the teacher stage's
`prepare_group` uses), on the group in shard order, as the teacher stage grouped it.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pyarrow as pa

from tasks.viewer.data import IterationIndex, RunData, list_row
from tasks.viewer.render import credit_colour, segments, token_regions, weight_colour

logger = logging.getLogger(__name__)

HOVER_TOP = 20  # candidates shown per token: all K when K is smaller
_GROUP_COLUMNS = (
    "sample_id",
    "group_id",
    "prompt_messages",
    "response_text",
    "reward",
    "feedback",
    "finish_reason",
    "format_error",
    "teacher_prompt",
)


def policy_tokenizer(data: RunData, n: int) -> Any:
    """The tokenizer of the policy that sampled iteration n (checkpoint n - 1), fetched without the
    checkpoint's weights."""
    from storage.checkpoints import resolve_checkpoint
    from tasks.tokenizers import stored_tokenizer

    cfg = data.run.cfg.storage
    manifest = resolve_checkpoint(data.layout, n - 1, "policy")
    return stored_tokenizer(data.layout, manifest, cache_dir=cfg.cache_dir, verify=cfg.verify_sha256)


def _round(values: np.ndarray, digits: int = 4) -> list[float | None]:
    return [None if not np.isfinite(v) else round(float(v), digits) for v in values]


def _weight_colour(weights: list[float | None] | None, t: int) -> str | None:
    value = None if weights is None else weights[t]
    return None if value is None else weight_colour(value)


def _token_texts(tokenizer: Any, ids: np.ndarray) -> dict[int, str]:
    unique = sorted(set(np.asarray(ids).ravel().tolist()))
    texts = tokenizer.batch_decode([[i] for i in unique], skip_special_tokens=False)
    return dict(zip(unique, texts, strict=True))


def response_tokens(tokenizer: Any, row: dict[str, Any], *, weights: np.ndarray | None) -> list[dict[str, Any]]:
    """Per response token: text, region, credit and colour, the teacher's entropy and the entropy
    weight, and its top-K alternatives.

    Keys: `text`, `region`, `credit` (teacher - student log-prob of the sampled token, None before the
    teacher stage), `colour`, `student`, `teacher` (log-probs of the sampled token), `entropy` (the
    teacher's next-token entropy in nats, None before the teacher stage), `weight` (`weights[t]`,
    the SRPO entropy weight; None where `weights` is None), `alternatives`: [{"text", "student",
    "teacher"}] probabilities of the student's top-K ids in the student's order; when K >
    HOVER_TOP, the HOVER_TOP ids that either model finds likeliest.
    """
    ids = np.asarray(row["response_ids"])
    n = len(ids)
    scored = "teacher_sampled_logprobs" in row
    student_p = np.exp(np.asarray(row["topk_logprobs"], dtype=np.float64).reshape(n, -1))
    teacher_p = np.exp(np.asarray(row["teacher_topk_logprobs"], dtype=np.float64).reshape(n, -1)) if scored else None
    # the HOVER_TOP candidates either model finds likeliest, kept in the student's order
    weight = student_p if teacher_p is None else np.maximum(student_p, teacher_p)
    shown = np.sort(np.argsort(-weight, axis=1, kind="stable")[:, :HOVER_TOP], axis=1)
    k = np.take_along_axis(np.asarray(row["topk_ids"]).reshape(n, -1), shown, axis=1)
    student_alt = np.round(np.take_along_axis(student_p, shown, axis=1), 4).tolist()
    student = _round(np.asarray(row["sampled_logprobs"], dtype=np.float64))
    if scored:
        teacher_alt = np.round(np.take_along_axis(teacher_p, shown, axis=1), 4).tolist()
        gap = np.asarray(row["teacher_sampled_logprobs"], dtype=np.float64) - np.asarray(row["sampled_logprobs"])
        teacher, credit = _round(np.asarray(row["teacher_sampled_logprobs"], dtype=np.float64)), _round(gap)
        entropy = _round(np.asarray(row["teacher_entropy"], dtype=np.float64))
    entropy_weight = None if weights is None else _round(np.asarray(weights, dtype=np.float64))
    texts = _token_texts(tokenizer, np.concatenate([ids, k.ravel()]))
    pieces = [texts[int(i)] for i in ids]
    regions = token_regions(pieces)
    tokens = []
    for t, piece in enumerate(pieces):
        tokens.append(
            {
                "text": piece,
                "region": regions[t],
                "credit": credit[t] if scored else None,
                "colour": credit_colour(credit[t]) if scored and credit[t] is not None else None,
                "student": student[t],
                "teacher": teacher[t] if scored else None,
                "entropy": entropy[t] if scored else None,
                "weight": None if entropy_weight is None else entropy_weight[t],
                "weight_colour": _weight_colour(entropy_weight, t),
                "alternatives": [
                    {
                        "text": texts[int(a)],
                        "student": student_alt[t][j],
                        "teacher": teacher_alt[t][j] if scored else None,
                    }
                    for j, a in enumerate(k[t].tolist())
                ],
            }
        )
    return tokens


def _group_records(data: RunData, n: int, rows: np.ndarray) -> list[Any]:
    from tasks.teacher import sample_records

    table = data.read_samples(n, rows, columns=_GROUP_COLUMNS)
    return sample_records({name: table.column(name).to_pylist() for name in _GROUP_COLUMNS})


def demonstrations(data: RunData, index: IterationIndex, group_id: int) -> dict[int, int | None]:
    """{sample_id: sample_id of the demonstration its teacher saw, or None} for one group.

    Empty before the teacher stage and for GRPO runs, whose teacher sees no demonstration.
    """
    from tasks.teacher import feedback_policy

    if not index.scored or data.run.cfg.loss.type == "grpo":
        return {}
    rows = index.rows_of_group(group_id)
    records = _group_records(data, index.iteration, rows)
    demos = feedback_policy(data.run.cfg).demonstrations(records)
    return {r.sample_id: None if d is None else records[d].sample_id for r, d in zip(records, demos, strict=True)}


def mask_reason(data: RunData, index: IterationIndex, i: int, *, demo: int | None, feedback: str | None) -> str:
    """Why sample `i` is trained on or masked, in words."""
    from sdpo_core.feedback import RelaxSDPOFeedback, SDPOFeedback
    from tasks.teacher import feedback_policy

    cfg = data.run.cfg
    if not index.scored:
        return "not scored by the teacher yet: the teacher stage of this iteration is not committed"
    if cfg.loss.type == "grpo":
        return "GRPO run: no teacher signal, every sample is masked for self-distillation"
    source = str(index.teacher_source[i])
    if index.mask[i]:
        return f"trained on; the teacher saw: {source}"
    policy = feedback_policy(cfg)
    if isinstance(policy, SDPOFeedback):
        group = index.rows_of_group(int(index.group_id[i]))
        successes = group[index.reward[group] >= policy.success_threshold]
        if successes.size == 0:
            why_demo = f"no sample of the group reached the success threshold {policy.success_threshold}"
        else:
            why_demo = "the only success of the group is this sample (dont_reprompt_on_self_success)"
        if not policy.include_environment_feedback:
            why_feedback = "environment feedback is switched off (include_environment_feedback)"
        else:
            why_feedback = "the verifier returned no feedback" if feedback is None else "feedback was not used"
        return f"masked: no demonstration ({why_demo}) and no feedback ({why_feedback})"
    if isinstance(policy, RelaxSDPOFeedback):
        return (
            "masked: no success in the group, and the sample is neither a format error nor truncated "
            "with feedback (the Relax rules)"
        )
    return f"masked by the feedback policy {cfg.teacher.feedback!r} (teacher source {source!r}, demo {demo})"


def route_reason(data: RunData, index: IterationIndex, i: int) -> str | None:
    """Why SRPO sent sample `i` where it did, in words; None when the run does not route."""
    from tasks.teacher import feedback_policy, success_threshold

    cfg = data.run.cfg
    if not index.scored or cfg.loss.type != "srpo":
        return None
    threshold = success_threshold(feedback_policy(cfg))
    reward, route = float(index.reward[i]), str(index.route[i])
    taught = "a successful sibling's answer" if cfg.loss.srpo.route == "failed_with_solution" else "any teacher context"
    if route == "sdpo":
        return f"SDPO: it failed (reward {reward:g} < {threshold:g}) and its teacher saw {taught}"
    if reward >= threshold:
        return f"GRPO: it succeeded (reward {reward:g} >= {threshold:g})"
    return f"GRPO: it failed (reward {reward:g} < {threshold:g}) but its teacher did not see {taught}"


def entropy_weights(data: RunData, index: IterationIndex, i: int, entropy: Any) -> np.ndarray | None:
    """Sample `i`'s SRPO entropy weights per token, exp(-beta H) over the iteration's norm; None
    unless the run is SRPO and the sample went to SDPO."""
    cfg = data.run.cfg
    if cfg.loss.type != "srpo" or index.route is None or index.route[i] != "sdpo":
        return None
    if index.entropy_weight_norm is None:
        raise RuntimeError(
            f"iteration {index.iteration} routes sample {int(index.sample_id[i])} to SDPO but has no norm"
        )
    raw: np.ndarray = np.exp(-cfg.loss.srpo.beta * np.asarray(entropy, dtype=np.float64))
    return raw / index.entropy_weight_norm


def _row_dict(table: pa.Table) -> dict[str, Any]:
    from storage.shard_columns import ragged, topk

    row: dict[str, Any] = {}
    for name in table.column_names:
        column = table.column(name)
        if pa.types.is_list(column.type) and pa.types.is_fixed_size_list(column.type.value_type):
            row[name] = topk(table, name).values
        elif pa.types.is_list(column.type) and not pa.types.is_struct(column.type.value_type):
            row[name] = ragged(table, name).values
        else:
            row[name] = column.to_pylist()[0]
    return row


def sample_detail(data: RunData, n: int, sample_id: int) -> dict[str, Any]:
    """Everything the sample pane shows about one sample."""
    index = data.index(n)
    i = index.index_of(sample_id)
    row = _row_dict(data.read_samples(n, np.array([i])))
    tokenizer = policy_tokenizer(data, n)
    prompt_text = tokenizer.decode(list(map(int, row["prompt_ids"])), skip_special_tokens=False)
    demo = demonstrations(data, index, int(index.group_id[i])).get(sample_id)
    teacher_text = row.get("teacher_prompt_text")
    return {
        **list_row(index, i),
        "iteration": n,
        "prompt_id": row["prompt_id"],
        "prompt": segments(prompt_text),
        "response": segments(row["response_text"]),
        "tokens": response_tokens(
            tokenizer, row, weights=entropy_weights(data, index, i, row["teacher_entropy"]) if index.scored else None
        ),
        "label": row["label"],
        "feedback": row["feedback"],
        "format_error": bool(row["format_error"]),
        "advantage": None if row.get("advantage") is None else round(float(row["advantage"]), 6),
        "teacher_prompt": None if teacher_text is None else segments(teacher_text),
        "demonstration": demo,
        "mask_reason": mask_reason(data, index, i, demo=demo, feedback=row["feedback"]),
        "route_reason": route_reason(data, index, i),
        "pass_rate": None if row.get("pass_rate") is None else round(float(row["pass_rate"]), 6),
    }


def group_detail(data: RunData, n: int, group_id: int) -> dict[str, Any]:
    """All G answers to one prompt, with rewards and the demonstration each teacher saw."""
    index = data.index(n)
    rows = index.rows_of_group(group_id)
    records = _group_records(data, n, rows)
    demos = demonstrations(data, index, group_id)
    served = {d for d in demos.values() if d is not None}
    members = []
    for i, record in zip(rows, records, strict=True):
        members.append(
            {
                **list_row(index, int(i)),
                "response": segments(record.response_text),
                "demonstration": demos.get(record.sample_id),
                "served_as_demonstration": record.sample_id in served,
            }
        )
    return {
        "iteration": n,
        "group_id": group_id,
        "prompt": [{"role": m["role"], "content": m["content"]} for m in records[0].prompt_messages],
        "members": members,
    }
