"""Training batches from the teacher shards' columns: padded or packed micro-batches, the
mini-batch split of an iteration, and the loss normalisers of a mini-batch."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from tasks.config import RunConfig

# The teacher shard's columns a training step reads: the stage reads these alone (the shard's text
# columns, prompts, feedback and teacher contexts, are for the viewer and audits)
TRAIN_COLUMNS = (
    "sample_id",
    "prompt_ids",
    "response_ids",
    "topk_ids",
    "sampled_logprobs",
    "teacher_topk_logprobs",
    "teacher_sampled_logprobs",
    "advantage",
    "sample_mask",
    "route",
    "pass_rate",
    "teacher_entropy",
)


@dataclass
class Batch:
    """Padded tensors of one micro-batch. B samples, S = longest prompt+response, T = longest response."""

    tokens: Any  # [B, S] int64, right padded
    position_ids: Any  # [B, S]
    # [B, T] flat index b * S' + s into the micro-batch's logits [B' * S'] of the position that
    # predicts response token t (a padded batch: b * S + its position; packed: `tasks.megatron.packing`)
    logit_rows: Any
    response_ids: Any  # [B, T]
    response_mask: Any  # [B, T] bool
    topk_ids: Any  # [B, T, K]
    teacher_topk_logprobs: Any  # [B, T, K]
    teacher_token_logprobs: Any  # [B, T]
    old_token_logprobs: Any  # [B, T] behaviour policy (rollout engine)
    advantages: Any  # [B]
    sample_mask: Any  # [B] bool
    route_sdpo: Any  # [B] bool, SRPO's route is "sdpo" (False also where the loss does not route)
    pass_rate: Any  # [B] the pass rate of the sample's question
    teacher_entropy: Any  # [B, T] teacher's next-token entropy
    # Packed micro-batches (train.packing): tokens is one row [1, L] of the samples end to end.
    packed_seq_params: Any = None  # Megatron PackedSeqParams (thd, boundaries on the CPU)

    def scored_rows(self) -> Any:
        """The flat positions b * S' + s of `tokens` [B', S'] whose logits predict a response token,
        in the row-major order of `response_mask` [B, T]: [N]."""
        return self.logit_rows[self.response_mask]

    def to(self, device: Any) -> Batch:
        """The same batch with its tensors on `device` (the packing boundaries stay on the CPU)."""
        moved = {
            f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self) if f.name != "packed_seq_params"
        }
        return dataclasses.replace(self, **moved)


def make_batch(columns: dict[str, Any], rows: list[int]) -> Batch:
    """Pad the given rows of the teacher columns into one micro-batch (no per-token Python loops)."""
    import torch

    prompts = [np.asarray(columns["prompt_ids"][i], dtype=np.int64) for i in rows]
    responses = [np.asarray(columns["response_ids"][i], dtype=np.int64) for i in rows]
    k = int(np.asarray(columns["topk_ids"][rows[0]]).shape[-1])
    b = len(rows)
    s = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    t = max(1, max(len(r) for r in responses))
    tokens = np.zeros((b, s), dtype=np.int64)
    logit_rows = np.zeros((b, t), dtype=np.int64)
    resp_ids = np.zeros((b, t), dtype=np.int64)
    mask = np.zeros((b, t), dtype=bool)
    topk_ids = np.zeros((b, t, k), dtype=np.int64)
    teacher_topk = np.zeros((b, t, k), dtype=np.float32)
    teacher_tok = np.zeros((b, t), dtype=np.float32)
    old_tok = np.zeros((b, t), dtype=np.float32)
    entropy = np.zeros((b, t), dtype=np.float32)
    for j, (i, p, r) in enumerate(zip(rows, prompts, responses, strict=True)):
        n_p, n_r = len(p), len(r)
        tokens[j, :n_p] = p
        tokens[j, n_p : n_p + n_r] = r
        logit_rows[j, :n_r] = j * s + np.arange(n_p - 1, n_p - 1 + n_r)
        resp_ids[j, :n_r] = r
        mask[j, :n_r] = True
        topk_ids[j, :n_r] = np.asarray(columns["topk_ids"][i])
        teacher_topk[j, :n_r] = np.asarray(columns["teacher_topk_logprobs"][i])
        teacher_tok[j, :n_r] = np.asarray(columns["teacher_sampled_logprobs"][i])
        old_tok[j, :n_r] = np.asarray(columns["sampled_logprobs"][i])
        entropy[j, :n_r] = np.asarray(columns["teacher_entropy"][i])
    positions = np.broadcast_to(np.arange(s, dtype=np.int64), (b, s)).copy()
    return Batch(
        tokens=torch.from_numpy(tokens),
        position_ids=torch.from_numpy(positions),
        logit_rows=torch.from_numpy(logit_rows),
        response_ids=torch.from_numpy(resp_ids),
        response_mask=torch.from_numpy(mask),
        topk_ids=torch.from_numpy(topk_ids),
        teacher_topk_logprobs=torch.from_numpy(teacher_topk),
        teacher_token_logprobs=torch.from_numpy(teacher_tok),
        old_token_logprobs=torch.from_numpy(old_tok),
        advantages=torch.as_tensor(np.asarray([columns["advantage"][i] for i in rows], dtype=np.float32)),
        sample_mask=torch.as_tensor(np.asarray([bool(columns["sample_mask"][i]) for i in rows])),
        route_sdpo=torch.as_tensor(np.asarray([columns["route"][i] == "sdpo" for i in rows], dtype=bool)),
        pass_rate=torch.as_tensor(np.asarray([columns["pass_rate"][i] for i in rows], dtype=np.float32)),
        teacher_entropy=torch.from_numpy(entropy),
    )


def make_packed_batch(columns: dict[str, Any], rows: list[int], *, pad_to_multiple: int = 8) -> Batch:
    """The rows as one packed row [1, L] (see `tasks.megatron.packing`), with the padded loss inputs."""
    from tasks.megatron.packing import pack_sequences

    batch = make_batch(columns, rows)
    packed = pack_sequences(
        [columns["prompt_ids"][i] for i in rows],
        [columns["response_ids"][i] for i in rows],
        pad_to_multiple=pad_to_multiple,
    )
    width = batch.response_ids.shape[1]
    logit_rows = packed.logit_rows.new_zeros((len(rows), width))
    logit_rows[:, : packed.logit_rows.shape[1]] = packed.logit_rows[:, :width]
    return dataclasses.replace(
        batch,
        tokens=packed.tokens,
        position_ids=packed.position_ids,
        logit_rows=logit_rows,
        packed_seq_params=packed.packed_seq_params(),
    )


def micro_batches(cfg: RunConfig, columns: dict[str, Any], rows: list[int]) -> list[Batch]:
    """This rank's micro-batches: `micro_batch_size` padded rows each, or token-budget packs."""
    if not cfg.train.packing:
        size = cfg.train.micro_batch_size
        return [make_batch(columns, rows[i : i + size]) for i in range(0, len(rows), size)]
    from tasks.megatron.packing import plan_packs

    lengths = [len(columns["prompt_ids"][i]) + len(columns["response_ids"][i]) for i in rows]
    packs = plan_packs(lengths, capacity=cfg.train.pack_tokens)
    return [make_packed_batch(columns, [rows[j] for j in pack]) for pack in packs]


class Normalisers(NamedTuple):
    """What every micro-batch of a mini-batch divides by, computed on the whole mini-batch, so the
    summed micro-batch losses equal the mini-batch loss (`sdpo_core.losses.LossInputs`)."""

    sdpo: Any  # the SDPO term's count
    grpo: Any  # the GRPO (and SRPO) term's count: every sample
    entropy_weight: Any  # SRPO: mean exp(-beta H) over the SDPO tokens; None for other losses
    question_weight: Any  # mean sqrt(p(1-p)) over the SDPO-trained samples; None unless loss.pass_rate_weight


def mini_batch_denominators(cfg: RunConfig, columns: dict[str, Any], rows: list[int]) -> Normalisers:
    """The loss normalisers of a whole mini-batch. Only the response lengths, sample masks, routes,
    pass rates and teacher entropies are read (what `make_batch` would build)."""
    import torch

    from sdpo_core.reductions import loss_denominator
    from sdpo_core.weights import entropy_weights, question_weights, weight_norm

    lengths = torch.tensor([len(columns["response_ids"][i]) for i in rows])
    response_mask = torch.arange(max(1, int(lengths.max()))) < lengths[:, None]  # [B, T]
    sample_mask = torch.as_tensor(np.asarray([bool(columns["sample_mask"][i]) for i in rows]))
    route_sdpo = torch.as_tensor(np.asarray([columns["route"][i] == "sdpo" for i in rows], dtype=bool))
    kw = {"reduction": cfg.loss.mask_reduction, "aggregation": cfg.loss.aggregation}
    sdpo = loss_denominator(response_mask, sample_mask, **kw)
    grpo = loss_denominator(response_mask, torch.ones_like(sample_mask), **kw)
    trained = route_sdpo if cfg.loss.type == "srpo" else sample_mask  # the samples the SDPO term trains
    entropy_weight = question_weight = None
    if cfg.loss.type == "srpo":
        entropy = np.concatenate([np.asarray(columns["teacher_entropy"][i], dtype=np.float64) for i in rows])
        tokens = torch.from_numpy(np.repeat(trained.numpy(), lengths.numpy()))  # [N] tokens of routed samples
        weights = entropy_weights(torch.from_numpy(entropy), beta=cfg.loss.srpo.beta)
        entropy_weight = weight_norm(weights, tokens)
    if cfg.loss.pass_rate_weight:
        rates = torch.as_tensor(np.asarray([columns["pass_rate"][i] for i in rows], dtype=np.float64))
        question_weight = weight_norm(question_weights(rates), trained)
    return Normalisers(sdpo=sdpo, grpo=grpo, entropy_weight=entropy_weight, question_weight=question_weight)


def minibatch_rows(n_rows: int, *, steps: int, seed: int, iteration: int) -> list[list[int]]:
    """The rows of each optimizer step: a seeded shuffle split into `steps` equal mini-batches."""
    if n_rows % steps:
        raise ValueError(f"{n_rows} samples cannot be split into {steps} equal mini-batches")
    order = list(range(n_rows))
    random.Random(f"train:{seed}:{iteration}").shuffle(order)
    size = n_rows // steps
    return [order[i * size : (i + 1) * size] for i in range(steps)]
