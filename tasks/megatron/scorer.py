"""Teacher scoring with a Megatron forward pass: the trainer's model provider, packed, tensor parallel.

The same scores as `tasks.engines.scorer.score_teacher` (log-probs of each response token at the
student's top-K ids and at the sampled id, and the entropy of each next-token distribution over the
full vocabulary, `TeacherScores` in input order), computed with the
Megatron `GPTModel` the trainer builds (`tasks.megatron.model.build_gpt_model`) instead of the HF
model. This is the backend `teacher.backend = "megatron"` selects; on a GPU it runs bf16 with the
SDPA core attention.

How:
- Sequences are packed end to end (`tasks.megatron.packing`) into rows of at most `batch_tokens`
  tokens; attention stays inside each sequence, so no padding is computed.
- Under tensor parallelism the logits stay vocab-sharded (`parallel_output=True`); the
  logsumexp, the gather of the K+1 ids and the entropy are vocab-parallel
  (`tasks.megatron.vocab_parallel`): the entropy is exact over the whole vocabulary, its shards
  combined by one max and one sum across the ranks.
  Every rank of the tensor-parallel group must call `score` with the same sequences, and all
  get the same scores. Split work across data-parallel ranks before calling.
- Only response positions are scored, `logit_chunk_tokens` rows at a time, so the float32 work
  is [logit_chunk_tokens, V / tp] at most (the bf16 logits of one packed row are the largest
  tensor).
- With a reference model and `trust_region_rate` tau, the teacher's logits are
  (1 - tau) * z_reference + tau * z_model, mixed in float32 chunk by chunk.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tasks.engines.scorer import TeacherScores, check_scoring_inputs

__all__ = ["MegatronTeacherScorer", "score_teacher_megatron"]

logger = logging.getLogger(__name__)


def _load(hf_dir: str | Path, *, dtype: torch.dtype, fused_kernels: bool = False) -> tuple[Any, Any]:
    from transformers import AutoConfig

    from tasks.megatron.convert import load_hf_into_megatron
    from tasks.megatron.model import build_gpt_model

    hf_config = AutoConfig.from_pretrained(str(hf_dir))
    model = build_gpt_model(
        hf_config, params_dtype=dtype, parallel_output=True, attention="sdpa", fused_kernels=fused_kernels
    )
    load_hf_into_megatron(model, str(hf_dir))
    return model.eval(), hf_config


class MegatronTeacherScorer:
    """A forward-only Megatron teacher (and optional trust-region reference) kept on this process.

    Build it from HF folders with `from_hf`, or around already built models (benchmarks build
    randomly initialised ones). The models must come from `build_gpt_model(..., parallel_output=
    True, attention="sdpa")`: packed rows need the SDPA core attention.
    """

    def __init__(self, model: Any, *, vocab_size: int, reference: Any | None = None) -> None:
        from tasks.megatron.output_rows import OutputRows

        self.model = model.eval()
        self.reference = reference.eval() if reference is not None else None
        self.vocab_size = int(vocab_size)
        self.device = next(self.model.parameters()).device
        # the output layer projects the scored positions alone (prompt positions are never scored)
        self._rows = {id(m): OutputRows(m) for m in (self.model, self.reference) if m is not None}

    def _logits(self, model: Any, tokens: Any, positions: Any, params: Any, rows: Any) -> Any:
        """The model's logits at the packed row's positions `rows` alone: [N, V / tp]."""
        with self._rows[id(model)].only(rows):
            return model(tokens, positions, None, packed_seq_params=params)[0]

    @classmethod
    def from_hf(
        cls,
        hf_dir: str | Path,
        *,
        tensor_parallel: int = 1,
        dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
        reference_dir: str | Path | None = None,
        fused_kernels: bool = False,
    ) -> MegatronTeacherScorer:
        """Initialise model parallelism and load the teacher (and reference) HF checkpoints;
        `fused_kernels` as in `tasks.megatron.model.build_gpt_model` (CUDA)."""
        from tasks.megatron.parallel import init_parallel

        init_parallel(tensor_parallel=tensor_parallel, seed=seed)
        model, hf_config = _load(hf_dir, dtype=dtype, fused_kernels=fused_kernels)
        reference = None
        if reference_dir is not None:
            reference, ref_config = _load(reference_dir, dtype=dtype, fused_kernels=fused_kernels)
            if int(ref_config.vocab_size) != int(hf_config.vocab_size):
                raise ValueError(f"reference vocab {ref_config.vocab_size} != teacher vocab {hf_config.vocab_size}")
        return cls(model, vocab_size=int(hf_config.vocab_size), reference=reference)

    @torch.no_grad()
    def score(
        self,
        *,
        sequences: list[tuple[list[int], list[int]]],
        topk_ids: list[np.ndarray],
        batch_tokens: int,
        logit_chunk_tokens: int = 1024,
        trust_region_rate: float | None = None,
        pad_to_multiple: int = 8,
    ) -> list[TeacherScores]:
        """Log-probs of each (prompt_ids, response_ids) pair's response at `topk_ids[i]` [T_i, K] and
        at the sampled ids, and the entropies; see `tasks.engines.scorer.score_teacher` for the contract."""
        from megatron.core import parallel_state

        from sdpo_core.teacher_update import trust_region_logits
        from tasks.megatron.packing import pack_sequences, plan_packs
        from tasks.megatron.scoring_kernel import fused_token_scores
        from tasks.megatron.vocab_parallel import vocab_parallel_token_entropy, vocab_parallel_token_logprobs

        if (self.reference is None) != (trust_region_rate is None):
            raise ValueError(
                f"trust_region_rate={trust_region_rate} needs a reference model and vice versa "
                f"(reference {'loaded' if self.reference is not None else 'absent'})"
            )
        k = check_scoring_inputs(sequences, topk_ids, logit_chunk_tokens=logit_chunk_tokens, vocab_size=self.vocab_size)
        group = parallel_state.get_tensor_model_parallel_group()

        results: list[TeacherScores | None] = [None] * len(sequences)
        lengths = [len(p) + len(r) for p, r in sequences]
        for pack in plan_packs(lengths, capacity=batch_tokens):
            packed = pack_sequences(
                [sequences[i][0] for i in pack], [sequences[i][1] for i in pack], pad_to_multiple=pad_to_multiple
            )
            tokens = packed.tokens.to(self.device)
            positions = packed.position_ids.to(self.device)
            params = packed.packed_seq_params()
            response_rows = packed.response_rows.to(self.device)  # [N]
            logits = self._logits(self.model, tokens, positions, params, response_rows)  # [N, V/tp]
            ref_logits = None
            if self.reference is not None:
                ref_logits = self._logits(self.reference, tokens, positions, params, response_rows)
            per_sample = [
                np.concatenate(
                    [np.asarray(topk_ids[i], dtype=np.int64), np.asarray(sequences[i][1], dtype=np.int64)[:, None]],
                    axis=1,
                )
                for i in pack
            ]
            ids = torch.from_numpy(np.concatenate(per_sample)).to(self.device)  # [N, K+1]
            rows = torch.arange(logits.shape[0], device=self.device)  # the logits' rows, in order
            parts, entropy_parts = [], []
            if ref_logits is None and logits.is_cuda and parallel_state.get_tensor_model_parallel_world_size() == 1:
                # one pass over each row's logits (tasks/megatron/scoring_kernel.py)
                scored_rows, entropy_rows = fused_token_scores(logits, rows, ids, vocab_size=self.vocab_size)
                parts, entropy_parts = [scored_rows], [entropy_rows]
                rows = rows[:0]  # nothing left for the chunked path below
            for c0 in range(0, rows.shape[0], logit_chunk_tokens):
                r = rows[c0 : c0 + logit_chunk_tokens]
                chunk = logits.index_select(0, r)  # [C, V/tp]
                if ref_logits is not None:
                    reference = ref_logits.index_select(0, r).float()
                    chunk = trust_region_logits(reference, chunk.float(), rate=trust_region_rate)
                local_rows = torch.arange(r.shape[0], device=self.device)
                parts.append(
                    vocab_parallel_token_logprobs(
                        chunk,
                        local_rows,
                        ids[c0 : c0 + logit_chunk_tokens],
                        group=group,
                        vocab_size=self.vocab_size,
                        chunk_tokens=logit_chunk_tokens,
                    )
                )
                entropy_parts.append(
                    vocab_parallel_token_entropy(
                        chunk, local_rows, group=group, vocab_size=self.vocab_size, chunk_tokens=logit_chunk_tokens
                    )
                )
            scored = (torch.cat(parts) if parts else torch.zeros((0, k + 1))).float().cpu().numpy()  # [N, K+1]
            entropy = (torch.cat(entropy_parts) if entropy_parts else torch.zeros(0)).float().cpu().numpy()  # [N]
            bounds = np.cumsum([0] + [len(sequences[i][1]) for i in pack])
            for j, i in enumerate(pack):
                mine = scored[bounds[j] : bounds[j + 1]]
                results[i] = TeacherScores(
                    topk_logprobs=np.ascontiguousarray(mine[:, :k], dtype=np.float32),
                    sampled_logprobs=np.ascontiguousarray(mine[:, k], dtype=np.float32),
                    entropy=np.ascontiguousarray(entropy[bounds[j] : bounds[j + 1]], dtype=np.float32),
                )
        return results  # type: ignore[return-value]


def score_teacher_megatron(
    scorer: MegatronTeacherScorer,
    *,
    sequences: list[tuple[list[int], list[int]]],
    topk_ids: list[np.ndarray],
    batch_tokens: int,
    trust_region_rate: float | None = None,
) -> list[TeacherScores]:
    """The teacher stage's scoring: every sequence scored once across the data-parallel replicas,
    and every rank gets every result."""
    from megatron.core import parallel_state

    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    if dp_size == 1:
        return scorer.score(
            sequences=sequences, topk_ids=topk_ids, batch_tokens=batch_tokens, trust_region_rate=trust_region_rate
        )
    # Data-parallel replicas score every dp_size-th sequence, then all of them get every result.
    mine = list(range(dp_rank, len(sequences), dp_size))
    scored = scorer.score(
        sequences=[sequences[i] for i in mine],
        topk_ids=[topk_ids[i] for i in mine],
        batch_tokens=batch_tokens,
        trust_region_rate=trust_region_rate,
    )
    shares: list[Any] = [None] * dp_size
    torch.distributed.all_gather_object(shares, scored, group=parallel_state.get_data_parallel_group())
    results: list[TeacherScores] = [None] * len(sequences)  # type: ignore[list-item]
    for r, share in enumerate(shares):
        for i, item in zip(range(r, len(sequences), dp_size), share, strict=True):
            results[i] = item
    return results
