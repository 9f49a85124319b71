"""In-process rollout engine: batched sampling from an HF causal LM with a KV cache.

For the offline demo and tests (tiny models on CPU), where a server would be overhead. Prompts of a
batch are left-padded, so every row's next token is predicted at the last column; explicit
position ids keep each row's positions starting at 0 regardless of its padding.

Decoding writes into preallocated buffers: the KV cache of a batch holds its final length from the
prompt's forward on (`PreallocatedLayer`; a decode step writes one slot and attends a view of the
filled prefix, where a growing cache would copy itself every step; `tasks.engines.decoding`), and
so does the attention mask. Rows whose answer has stopped leave the decode once an eighth of the
decoding rows has stopped (their KV cache rows too), so the remaining steps run on live rows only.

Two decode loops share the prompt's forward and the draws (`tasks.engines.sampling`): on the CPU
one forward per step from Python (`_decode_eagerly`); on a GPU each step replays a captured CUDA
graph over a fixed-capacity cache, with rows leaving in batch-size buckets
(`tasks.engines.graph_decode`). `decode=` picks one explicitly (the tests compare them).

Sampling is reproducible per sample: the uniform draws of sample j of prompt i come from a
generator seeded with (seed, i, j), so a sample does not depend on which other prompts share its
batch or on `max_batch_size` (up to float round-off in the batched matmuls).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from tasks.engines.base import Generation, RolloutEngine, SamplingParams
from tasks.engines.sampling import DROP_FINISHED_AT, GPU_STOP_CHECK_EVERY, DecodeOutputs, DrawSettings, sample_step

__all__ = ["EmbeddedEngine"]

logger = logging.getLogger(__name__)

_PAD_ID = 0  # what fills padded slots; they are masked out, so any valid id works


class EmbeddedEngine(RolloutEngine):
    """A `RolloutEngine` running an HF `AutoModelForCausalLM` in this process."""

    def __init__(
        self,
        checkpoint_dir: str,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_size: int,
        decode: Literal["auto", "eager", "static"] = "auto",
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if decode not in ("auto", "eager", "static"):
            raise ValueError(f"decode={decode!r}; it must be 'auto', 'eager' or 'static'")
        self._device = torch.device(device)
        # the static loop (tasks/engines/graph_decode.py) replays CUDA graphs on a GPU; elsewhere it
        # runs its steps eagerly (what the CPU tests of that loop use); auto: graphs on a GPU only
        self._static_decode = decode == "static" or (decode == "auto" and self._device.type == "cuda")
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

        # on the CPU a decode step attends with grouped GEMMs; a captured step with its bounded decode
        # attention; the rest with SDPA (tasks/engines/decoding.py)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=self._dtype, attn_implementation=register_decode_attention()
        )
        self._model = model.to(self._device).eval()
        if self._device.type == "cuda":  # one kernel per RMSNorm instead of six
            from tasks.engines.norm_kernel import use_fused_rms_norms

            use_fused_rms_norms(self._model)
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

        from tasks.progress_bars import bar_disabled

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
        for start in tqdm(starts, desc="rollout", unit="batch", disable=bar_disabled(progress)):
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

        # only the last position's logits: the whole prompt's would be [B, width, V] (gigabytes at a
        # 50k vocabulary and a few hundred prompt tokens) for one row of them to be read
        static = self._static_decode
        # on the CPU the keys lie position-contiguous for the decode attention's GEMMs (decoding.py)
        cache = preallocated_cache(
            model.config, capacity=width + max_new_tokens, keys_transposed=device.type == "cpu" and not static
        )
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        # [B, V]: on a GPU in the model's dtype (the draw reads it as it is), else float32
        logits = out.logits[:, -1, :] if device.type == "cuda" else out.logits[:, -1, :].float()
        outputs = DecodeOutputs.allocate(batch, max_new_tokens, top_k, device)
        settings = DrawSettings(uniforms=u, temperature=temperature, top_p=top_p, stop_ids=stop_ids)
        if static:
            from tasks.engines import graph_decode

            graph_decode.decode(
                model, cache, logits=logits, lengths=lengths, width=width, max_new_tokens=max_new_tokens,
                settings=settings, out=outputs, capture=device.type == "cuda",
            )  # fmt: skip
        else:
            self._decode_eagerly(
                cache, logits=logits, attention_mask=attention_mask, lengths=lengths, width=width,
                max_new_tokens=max_new_tokens, settings=settings, out=outputs,
            )  # fmt: skip
        return _generations(outputs, stop_token_ids)

    def _decode_eagerly(
        self,
        cache: Any,
        *,
        logits: torch.Tensor,
        attention_mask: torch.Tensor,
        lengths: torch.Tensor,
        width: int,
        max_new_tokens: int,
        settings: DrawSettings,
        out: DecodeOutputs,
    ) -> None:
        """One forward per step from Python, the cache's filled prefix sliced by host integers."""
        model, device = self.model, self._device
        batch = logits.shape[0]
        # the prompt's columns, then one per decode step: written once, passed as a growing view
        full_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, max_new_tokens)], dim=1)
        next_position = lengths.clone()  # [B]
        # asking how many rows are still decoding waits for the device; on a GPU ask every few steps so
        # the host keeps queueing work (steps past a row's stop are not counted, so the result is the same)
        sync_every = 1 if device.type == "cpu" else GPU_STOP_CHECK_EVERY
        # The rows being decoded: decoding row i fills batch row `rows[i]`. Once an eighth of them
        # has stopped (`DROP_FINISHED_AT`), the stopped ones leave the decode with their KV cache,
        # so a batch whose answers differ in length does not run every row to the longest.
        rows = torch.arange(batch, device=device)  # [b]
        finished = torch.zeros(batch, dtype=torch.bool, device=device)  # [b]
        for step in range(max_new_tokens):
            token, finished = sample_step(
                logits, rows=rows, step=step, finished=finished, settings=settings, out=out,
            )  # fmt: skip
            if step == max_new_tokens - 1:
                break
            if step % sync_every == sync_every - 1:
                live = int(rows.numel() - finished.sum())
                if live == 0:
                    break
                if live <= rows.numel() * DROP_FINISHED_AT:
                    keep = (~finished).nonzero()[:, 0]  # [b']
                    rows, finished, token = rows[keep], finished[keep], token[keep]
                    next_position, full_mask = next_position[keep], full_mask[keep]
                    cache.batch_select_indices(keep)
            result = model(
                input_ids=token[:, None],
                attention_mask=full_mask[:, : width + step + 1],
                position_ids=next_position[:, None],
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            logits = result.logits[:, -1, :] if device.type == "cuda" else result.logits[:, -1, :].float()
            next_position = next_position + 1


def _generations(out: DecodeOutputs, stop_token_ids: list[int]) -> list[Generation]:
    """One `Generation` per batch row, read back from the decode's buffers."""
    tokens_np = out.tokens.cpu().numpy()  # [B, S]
    sampled_np = out.sampled.cpu().numpy()  # [B, S]
    topk_ids_np = out.topk_ids.cpu().numpy()  # [B, S, K]
    topk_lp_np = out.topk_logprobs.cpu().numpy()  # [B, S, K]
    num_tokens_np = out.num_tokens.cpu().numpy()  # [B]
    stop_set = set(stop_token_ids)
    generations = []
    for row in range(len(num_tokens_np)):
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
