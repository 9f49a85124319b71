"""The embedded engine's decode loop on a GPU: every step replays a captured CUDA graph.

An eager decode step of a 28-layer model is several hundred kernel launches from Python, and at a
few hundred rows the GPU waits on the host between them. Here one step (the draw and its records,
the model's forward with the KV cache write and the attention, the logits copied out, the counters
advanced) is captured once as a CUDA graph and replayed: the host's work per step is one replay.

What a graph needs, and how the loop provides it:
- Fixed addresses: the step reads and writes static tensors of its bucket (`_Bucket`: the rows,
  their last token, position, first cache column, finished flags and logits) and the batch's
  `DecodeOutputs`; the KV cache keeps its capacity and is written at `column`, a device tensor.
- No host values that change between steps: the step index, the cache column and the attention's
  end are device tensors [1] that the graph itself advances (`tasks.engines.decoding` documents the
  model's side: `decode_column`, `decode_start`, `decode_end`).
- Fixed shapes: rows whose answer stopped leave the decode in buckets (`BUCKETS`). Every 16 steps the
  host reads how many rows still decode; once that is at most 7/8 of the bucket and a smaller
  bucket holds them, the live rows (and finished rows as filler up to the bucket) move to new
  static tensors and KV buffers, and that bucket's graph is captured. Finished filler rows still
  draw and write past their stop, which is never read, as in the eager loop.

Capture: the first step in a bucket runs eagerly on a side stream (it is a real step: Triton's
kernels compile and cuBLAS sets up there, not inside the capture), then the step is captured
(capturing runs nothing) and replayed from the next step on. All of a batch's graphs share one
memory pool. The last step draws and records only (no forward: its logits would not be used), eagerly.

The draws are the eager loop's (`tasks.engines.sampling.sample_step`, uniforms from (seed, prompt,
sample)); a sample differs from the eager loop's only by float round-off of batched matmuls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tasks.engines.sampling import DROP_FINISHED_AT, GPU_STOP_CHECK_EVERY, DecodeOutputs, DrawSettings, sample_step

__all__ = ["BUCKETS", "bucket_for", "decode"]

logger = logging.getLogger(__name__)

# batch sizes a captured step runs at; a batch above the largest is its own bucket
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


def bucket_for(live: int, batch: int) -> int:
    """The smallest bucket holding `live` rows; the batch itself when no bucket below it does."""
    return next((b for b in BUCKETS if live <= b < batch), batch)


@dataclass
class _Bucket:
    """One bucket's static tensors (b rows); a captured step reads and writes only these."""

    rows: torch.Tensor  # [b] batch row of each decoding row
    finished: torch.Tensor  # [b] bool
    token: torch.Tensor  # [b] the last drawn token
    position: torch.Tensor  # [b] position id of the next forward's token
    start: torch.Tensor  # [b] first KV cache column of the row (its prompt's left padding ends there)
    logits: torch.Tensor  # [b, V] the logits the next draw reads (the model's dtype on a GPU)

    def select(self, keep: torch.Tensor) -> _Bucket:
        return _Bucket(
            *(
                t[keep].contiguous()
                for t in (self.rows, self.finished, self.token, self.position, self.start, self.logits)
            )
        )


@dataclass(frozen=True)
class _Counters:
    """Device tensors [1] the graph advances: the step, the cache column it writes, the attention's end."""

    step: torch.Tensor
    column: torch.Tensor
    end: torch.Tensor

    def advance(self) -> None:
        self.step.add_(1)
        self.column.add_(1)
        self.end.add_(1)


def decode(
    model: torch.nn.Module,
    cache: object,
    *,
    logits: torch.Tensor,
    lengths: torch.Tensor,
    width: int,
    max_new_tokens: int,
    settings: DrawSettings,
    out: DecodeOutputs,
    capture: bool = True,
) -> None:
    """Decode after the prompt's forward (`logits` [B, V] float32, the KV cache filled to `width`
    columns, row b's prompt in columns [width - lengths[b], width)), writing into `out`.

    `capture=False` runs the same steps eagerly (the CPU tests of this loop; a GPU reference).
    """
    device = logits.device
    batch = logits.shape[0]
    one = torch.ones(1, dtype=torch.long, device=device)
    counters = _Counters(step=one * 0, column=one * width, end=one * (width + 1))
    state = _Bucket(
        rows=torch.arange(batch, device=device),
        finished=torch.zeros(batch, dtype=torch.bool, device=device),
        token=torch.zeros(batch, dtype=torch.long, device=device),
        position=lengths.clone(),
        start=width - lengths,
        logits=logits,
    )

    def draw_and_record(s: _Bucket) -> None:
        token, finished = sample_step(
            s.logits, rows=s.rows, step=counters.step, finished=s.finished, settings=settings, out=out,
        )  # fmt: skip
        s.token.copy_(token)
        s.finished.copy_(finished)

    def step(s: _Bucket) -> None:
        draw_and_record(s)
        result = model(
            input_ids=s.token[:, None],
            attention_mask={"full_attention": None},  # the decode attention bounds each row itself
            position_ids=s.position[:, None],
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
            decode_column=counters.column,
            decode_start=s.start,
            decode_end=counters.end,
        )
        s.logits.copy_(result.logits[:, -1, :])
        s.position.add_(1)
        counters.advance()

    pool = torch.cuda.graph_pool_handle() if capture else None
    replay: Callable[[], None] | None = None
    captured = 0
    for index in range(max_new_tokens):
        if index == max_new_tokens - 1:
            draw_and_record(state)
            break
        if index and index % GPU_STOP_CHECK_EVERY == 0:
            live = int(state.rows.numel() - state.finished.sum())
            if live == 0:
                break
            size = bucket_for(live, state.rows.numel())
            if live <= state.rows.numel() * DROP_FINISHED_AT and size < state.rows.numel():
                keep = torch.argsort(state.finished.to(torch.int8), stable=True)[:size]  # live rows first
                state = state.select(keep)
                for layer in cache.layers:  # type: ignore[attr-defined]
                    layer.filled = width + index  # the columns a captured step wrote, as the host counts them
                    layer.batch_select_indices(keep)
                replay = None
        if not capture:
            step(state)
            continue
        if replay is None:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                step(state)  # a real step, run eagerly: compiles and sets up what the capture then records
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread-local: a train stage's writers may copy weights on another thread meanwhile
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                step(state)
            replay = graph.replay
            captured += 1
            continue
        replay()
    if captured:
        logger.debug("decode of %d rows: %d captured bucket(s)", batch, captured)
