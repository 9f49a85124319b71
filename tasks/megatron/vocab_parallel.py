"""Vocabulary-parallel student log-probs: the collectives for `sdpo_core.chunked` over a process group.

With tensor parallelism and `parallel_output=True` each rank holds logits for its contiguous
slice of the (padded) vocabulary, [rank * V_local, (rank + 1) * V_local). The streaming
logsumexp and the gather of the K ids run on the local slice; the partial results are combined
with two all-reduces of [N] floats (max, then sum of exp) and one of [N, K] (the gathered logits,
each contributed by the single rank holding that id). Full-vocabulary logits are never
gathered. The backward needs no communication: the loss is computed redundantly on every rank of
the group, so the upstream gradient is already the same everywhere, and the output layer's
backward all-reduces the hidden-state gradient (Megatron's column-parallel linear).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from sdpo_core.chunked import chunked_token_entropy, chunked_token_logprobs

__all__ = [
    "GroupReducer",
    "tensor_parallel_token_logprobs",
    "vocab_parallel_token_entropy",
    "vocab_parallel_token_logprobs",
]


class GroupReducer:
    """`sdpo_core.chunked.VocabReducer` over a torch.distributed process group."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def max_(self, tensor: Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)

    def sum_(self, tensor: Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)


def vocab_parallel_token_logprobs(
    local_logits: Tensor,
    rows: Tensor,
    ids: Tensor,
    *,
    group: dist.ProcessGroup,
    vocab_size: int,
    chunk_tokens: int = 1024,
    chunk_vocab: int | None = None,
    compile: bool = False,
) -> Tensor:
    """log softmax(full logits[rows])[ids] from this rank's vocabulary shard: [M, V_local] -> [N, K].

    `ids` are global vocabulary ids and `vocab_size` the unpadded global vocabulary. Every rank of
    `group` must call with the same `rows` and `ids`; all get the same result.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if world == 1:
        return chunked_token_logprobs(
            local_logits,
            rows,
            ids,
            vocab_size=vocab_size,
            chunk_tokens=chunk_tokens,
            chunk_vocab=chunk_vocab,
            compile=compile,
        )
    local = local_logits.shape[-1]
    if local * world < vocab_size:
        raise ValueError(f"{world} shards of {local} columns cannot hold vocab_size={vocab_size}")
    return chunked_token_logprobs(
        local_logits,
        rows,
        ids,
        vocab_size=vocab_size,
        vocab_start=rank * local,
        chunk_tokens=chunk_tokens,
        chunk_vocab=chunk_vocab,
        reducer=GroupReducer(group),
        compile=compile,
    )


def vocab_parallel_token_entropy(
    local_logits: Tensor,
    rows: Tensor,
    *,
    group: dist.ProcessGroup,
    vocab_size: int,
    chunk_tokens: int = 1024,
    chunk_vocab: int | None = None,
) -> Tensor:
    """Entropy of softmax(full logits[rows]) over the whole (unpadded) vocabulary from this rank's
    shard: [M, V_local] -> [N], forward only. Every rank of `group` must call with the same `rows`;
    all get the same result (one all-reduce of [N] maxima and one of [2, N] sums)."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    local = local_logits.shape[-1]
    if world > 1 and local * world < vocab_size:
        raise ValueError(f"{world} shards of {local} columns cannot hold vocab_size={vocab_size}")
    return chunked_token_entropy(
        local_logits,
        rows,
        vocab_size=vocab_size,
        vocab_start=rank * local if world > 1 else 0,
        chunk_tokens=chunk_tokens,
        chunk_vocab=chunk_vocab,
        reducer=GroupReducer(group) if world > 1 else None,
    )


def tensor_parallel_token_logprobs(
    logits: Tensor,
    rows: Tensor,
    ids: Tensor,
    *,
    vocab_size: int,
    chunk_tokens: int,
    compile: bool,
) -> Tensor:
    """The Megatron trainer's entry point: logits sharded over Megatron's tensor-parallel group."""
    from megatron.core import parallel_state

    return vocab_parallel_token_logprobs(
        logits,
        rows,
        ids,
        group=parallel_state.get_tensor_model_parallel_group(),
        vocab_size=vocab_size,
        chunk_tokens=chunk_tokens,
        compile=compile,
    )
