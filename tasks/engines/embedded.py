"""In-process rollout engine: batched sampling from an HF causal LM with a KV cache.

For the offline demo and tests (tiny models on CPU), where a server would be overhead. Prompts of a
batch are left-padded, so every row's next token is predicted at the last column; explicit
position ids keep each row's positions starting at 0 regardless of its padding.

Decoding writes into preallocated buffers: the KV cache of a batch holds its final length from the
prompt's forward on (`PreallocatedLayer`; a decode step writes one slot and attends a view of the
filled prefix, where a growing cache would copy itself every step; `tasks.engines.decoding`), and
so does the attention mask. Rows whose answer has stopped leave the decode once an eighth of the
decoding rows has stopped (their KV cache rows too), so the remaining steps run on live rows only.

Sampling is reproducible per sample: the uniform draws of sample j of prompt i come from a
generator seeded with (seed, i, j), so a sample does not depend on which other prompts share its
batch or on `max_batch_size` (up to float round-off in the batched matmuls).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tasks.engines.base import Generation, RolloutEngine, SamplingParams

__all__ = ["EmbeddedEngine"]

logger = logging.getLogger(__name__)

_PAD_ID = 0  # what fills padded slots; they are masked out, so any valid id works
_GPU_STOP_CHECK_EVERY = 16  # decode steps between checks of how many rows have stopped, on a GPU
# a decode drops its stopped rows once at most this share of its rows is still live: each drop copies
# the KV cache's filled prefix, and the rows kept run every step after it
_DROP_FINISHED_AT = 7 / 8


class EmbeddedEngine(RolloutEngine):
    """A `RolloutEngine` running an HF `AutoModelForCausalLM` in this process."""

    def __init__(
        self,
        checkpoint_dir: str,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_size: int,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self._device = torch.device(device)
        self._dtype = dtype
        self._max_batch_size = max_batch_size
        self._model: torch.nn.Module | None = None
        self._weight_version = ""
        self.load_weights(checkpoint_dir)

    @property
    def weight_version(self) -> str:
        return self._weight_version

    @property
    def model(self) -> torch.nn.Module:
        """The loaded model (eval mode); raises once the engine is closed."""
        if self._model is None:
            raise RuntimeError("the engine is closed")
        return self._model

    def load_weights(self, checkpoint_dir: str, *, weights: Mapping[str, Any] | None = None) -> None:
        from transformers import AutoModelForCausalLM

        path = Path(checkpoint_dir)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{checkpoint_dir!r} is not an HF checkpoint folder (no config.json)")
        if weights is not None and self._model is not None:
            from tasks.kept_weights import load_into

            self._weight_version = ""  # until every tensor is copied
            # the folder's weights, kept in memory by the stage that stored them: copied in place
            load_into(self._model, weights)
            self._weight_version = str(path.resolve())
            logger.info("embedded engine loaded %s from memory", self._weight_version)
            return
        from tasks.engines.decoding import register_decode_attention

        # on the CPU a decode step attends with grouped GEMMs (tasks/engines/decoding.py)
        attention = {"attn_implementation": register_decode_attention()} if self._device.type == "cpu" else {}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=self._dtype, **attention)
        self._model = model.to(self._device).eval()
        self._weight_version = str(path.resolve())
        logger.info("embedded engine loaded %s", self._weight_version)

    def close(self) -> None:
        self._model = None

    @torch.no_grad()
    def _sample(self, prompts: list[list[int]], params: SamplingParams, *, progress: bool) -> list[list[Generation]]:
        from tasks.megatron.compat import without_device_rewrite

        # a process that also trains with Megatron on the CPU rewrites CUDA devices through a torch
        # function mode, a Python hook on every torch call; decoding names no CUDA device
        with without_device_rewrite():
            return self._sample_batches(prompts, params, progress=progress)

    def _sample_batches(
        self, prompts: list[list[int]], params: SamplingParams, *, progress: bool
    ) -> list[list[Generation]]:
        from tqdm.auto import tqdm

        model = self.model
        vocab_size = model.config.vocab_size
        max_positions = model.config.max_position_embeddings
        n, max_new_tokens, seed = params.n, params.max_new_tokens, params.seed
        if params.top_k_logprobs > vocab_size:
            raise ValueError(f"top_k_logprobs={params.top_k_logprobs} must be in [0, vocab_size={vocab_size}]")
        for i, prompt in enumerate(prompts):
            if len(prompt) + max_new_tokens > max_positions:
                raise ValueError(
                    f"prompt {i} has {len(prompt)} tokens; with max_new_tokens={max_new_tokens} it exceeds "
                    f"the model's max_position_embeddings={max_positions}"
                )

        jobs = [(i, j) for i in range(len(prompts)) for j in range(n)]
        results: list[list[Generation]] = [[] for _ in prompts]
        starts = range(0, len(jobs), self._max_batch_size)
        for start in tqdm(starts, desc="rollout", unit="batch", disable=not progress):
            chunk = jobs[start : start + self._max_batch_size]
            uniforms = None
            if params.temperature > 0:
                uniforms = np.stack([np.random.default_rng([seed, i, j]).random(max_new_tokens) for i, j in chunk])
            generations = self._generate_batch(
                [prompts[i] for i, _ in chunk],
                uniforms=uniforms,
                temperature=params.temperature,
                top_p=params.top_p,
                max_new_tokens=max_new_tokens,
                stop_token_ids=params.stop_token_ids,
                top_k=params.top_k_logprobs,
            )
            for (i, _), generation in zip(chunk, generations, strict=True):
                results[i].append(generation)
        return results

    def _generate_batch(
        self,
        prompts: list[list[int]],
        *,
        uniforms: np.ndarray | None,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        stop_token_ids: list[int],
        top_k: int,
    ) -> list[Generation]:
        from tasks.engines.decoding import preallocated_cache

        model = self.model
        device = self._device
        batch = len(prompts)
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        width = int(lengths.max())
        input_ids = torch.full((batch, width), _PAD_ID, dtype=torch.long, device=device)
        attention_mask = torch.zeros((batch, width), dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, device=device)
            attention_mask[row, width - len(prompt) :] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        stop_ids = torch.tensor(stop_token_ids, dtype=torch.long, device=device)
        u = None if uniforms is None else torch.from_numpy(uniforms).to(device)  # [B, max_new_tokens]

        # the prompt's columns, then one per decode step: written once, passed as a growing view
        full_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, max_new_tokens)], dim=1)
        # on the CPU the keys lie position-contiguous for the decode attention's GEMMs (decoding.py)
        cache = preallocated_cache(model.config, capacity=width + max_new_tokens, keys_transposed=device.type == "cpu")
        # only the last position's logits: the whole prompt's would be [B, width, V] (gigabytes at a
        # 50k vocabulary and a few hundred prompt tokens) for one row of them to be read
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1, :].float()  # [B, V]
        next_position = lengths.clone()  # [B]
        # asking how many rows are still decoding waits for the device; on a GPU ask every few steps so
        # the host keeps queueing work (steps past a row's stop are not counted, so the result is the same)
        sync_every = 1 if device.type == "cpu" else _GPU_STOP_CHECK_EVERY
        # Each step's outputs go into buffers of the whole batch allocated here, once: small
        # per-step tensors kept alive between each step's large temporaries fragment the heap (on
        # the CPU a 512 x 256 call then held up to ~2 MB more per decode step, varying run to run).
        tokens = torch.zeros((batch, max_new_tokens), dtype=torch.long, device=device)  # [B, S]
        sampled = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device)  # [B, S]
        topk_ids_all = torch.zeros((batch, max_new_tokens, top_k), dtype=torch.int32, device=device)  # [B, S, K]
        topk_lp_all = torch.zeros((batch, max_new_tokens, top_k), dtype=torch.float32, device=device)  # [B, S, K]
        num_tokens = torch.zeros(batch, dtype=torch.long, device=device)  # [B]; active steps form a prefix
        # The rows being decoded: decoding row i fills batch row `rows[i]`. Once an eighth of them
        # has stopped (`_DROP_FINISHED_AT`), the stopped ones leave the decode with their KV cache,
        # so a batch whose answers differ in length does not run every row to the longest.
        rows = torch.arange(batch, device=device)  # [b]
        finished = torch.zeros(batch, dtype=torch.bool, device=device)  # [b]
        for step in range(max_new_tokens):
            logprobs = torch.log_softmax(logits, dim=-1)  # [b, V]
            if u is None:
                token = logprobs.argmax(dim=-1)
            else:
                # x / 1.0 is x: the common temperature skips a pass over [b, V]
                scaled = logits if temperature == 1.0 else logits / temperature
                token = _sample(scaled, top_p=top_p, u=u[rows, step])
            topk_lp, topk_ids = logprobs.topk(top_k, dim=-1)  # [b, K]
            tokens[rows, step] = token
            sampled[rows, step] = logprobs.gather(-1, token[:, None])[:, 0]
            topk_ids_all[rows, step] = topk_ids.to(torch.int32)
            topk_lp_all[rows, step] = topk_lp
            num_tokens[rows] += ~finished
            finished = finished | torch.isin(token, stop_ids)
            if step == max_new_tokens - 1:
                break
            if step % sync_every == sync_every - 1:
                live = int(rows.numel() - finished.sum())
                if live == 0:
                    break
                if live <= rows.numel() * _DROP_FINISHED_AT:
                    keep = (~finished).nonzero()[:, 0]  # [b']
                    rows, finished, token = rows[keep], finished[keep], token[keep]
                    next_position, full_mask = next_position[keep], full_mask[keep]
                    cache.batch_select_indices(keep)
            out = model(
                input_ids=token[:, None],
                attention_mask=full_mask[:, : width + step + 1],
                position_ids=next_position[:, None],
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            logits = out.logits[:, -1, :].float()
            next_position = next_position + 1

        tokens_np = tokens.cpu().numpy()  # [B, S]
        sampled_np = sampled.cpu().numpy()  # [B, S]
        topk_ids_np = topk_ids_all.cpu().numpy()  # [B, S, K]
        topk_lp_np = topk_lp_all.cpu().numpy()  # [B, S, K]
        num_tokens_np = num_tokens.cpu().numpy()  # [B]
        stop_set = set(stop_token_ids)
        generations = []
        for row in range(batch):
            count = int(num_tokens_np[row])
            response = tokens_np[row, :count].tolist()
            generations.append(
                Generation(
                    response_ids=response,
                    sampled_logprobs=sampled_np[row, :count].copy(),
                    topk_ids=topk_ids_np[row, :count].copy(),
                    topk_logprobs=topk_lp_np[row, :count].copy(),
                    finish_reason="stop" if response[-1] in stop_set else "length",
                )
            )
        return generations


def _sample(scaled_logits: torch.Tensor, *, top_p: float, u: torch.Tensor) -> torch.Tensor:
    """Draw one id per row by inverting the (top-p truncated) CDF at the given uniforms.

    scaled_logits: [B, V] (already divided by the temperature); u: [B] in [0, 1). Returns [B] ids.
    Without top-p the CDF is taken in vocabulary order (no sort: sorting the vocabulary was half of
    a decode step on the CPU); with top-p it is taken in descending probability, which the nucleus
    needs. Either way the draw is exact and a function of the logits and `u` alone.
    """
    probs = torch.softmax(scaled_logits, dim=-1)  # [B, V]
    if top_p >= 1.0:
        cdf = probs.cumsum(dim=-1)  # [B, V], non-decreasing
        target = u.to(cdf.dtype)[:, None] * cdf[:, -1:]
        # the first id whose CDF reaches the target; it has mass, since the CDF rises there
        return torch.searchsorted(cdf, target).clamp(max=probs.shape[-1] - 1)[:, 0]
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
    # keep the smallest prefix whose mass reaches top_p (the most likely token always stays)
    keep = (sorted_probs.cumsum(dim=-1) - sorted_probs) < top_p
    sorted_probs = sorted_probs * keep
    cdf = sorted_probs.cumsum(dim=-1)  # [B, V]
    target = u.to(cdf.dtype)[:, None] * cdf[:, -1:]
    choice = (cdf < target).sum(dim=-1)
    # round-off can push `target` past the last kept entry; clamp to the last token with mass
    last_kept = (sorted_probs > 0).sum(dim=-1) - 1
    choice = torch.minimum(choice, last_kept)
    return sorted_ids.gather(-1, choice[:, None])[:, 0]
