"""The output layer of a Megatron GPTModel run only at the positions the loss reads.

A training micro-batch's logits are needed where a position predicts a response token: prompt
positions, pack padding and the last position of each sample are never scored. Megatron's
`GPTModel._postprocess` projects every position through the output layer, and the loss then
gathers the response rows from [B' * S', V] logits: the projection, the gathered copy and, in the
backward pass, a zeroed [B' * S', V] gradient with the response rows scattered into it are all
paid for every position. `OutputRows` registers a forward pre-hook on `model.output_layer` that,
inside `OutputRows.only(rows)`, hands it the hidden states of those rows alone, as one sequence
[N, 1, h]; the logits come out as [1, N, V] in the rows' order. (Megatron does the same for
inference, where `_postprocess` keeps each request's last hidden state before the output layer.)
Outside the block the model runs unchanged. Sequence parallelism (hidden states split over the
sequence dimension) is refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import Tensor


class OutputRows:
    """Restricts a GPTModel's output layer to given flat positions [B' * S'] within `only`."""

    def __init__(self, model: Any) -> None:
        if model.config.sequence_parallel:
            raise NotImplementedError("OutputRows does not support sequence parallelism")
        self._rows: Tensor | None = None
        # first among the layer's pre-hooks, so it sees Megatron's [S', B', h] layout
        # (tasks.megatron.fusions.batch_first_logits transposes after it)
        model.output_layer.register_forward_pre_hook(self._select, with_kwargs=True, prepend=True)

    @contextlib.contextmanager
    def only(self, rows: Tensor) -> Iterator[None]:
        """Within the block the output layer projects the hidden states at `rows` (flat indices
        b * S' + s into the micro-batch, [N]) alone; the model returns logits [1, N, V]."""
        if rows.ndim != 1:
            raise ValueError(f"rows must be flat positions [N], got shape {tuple(rows.shape)}")
        if self._rows is not None:
            raise RuntimeError("OutputRows.only is already active: one forward pass at a time")
        self._rows = rows
        try:
            yield
        finally:
            self._rows = None

    def _select(self, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self._rows is None:
            return None
        hidden, *rest = args  # [S', B', h]
        s, b, h = hidden.shape
        flat = hidden.transpose(0, 1).reshape(b * s, h)  # batch-major, as the rows count
        return (flat[self._rows].unsqueeze(1), *rest), kwargs  # [N, 1, h]
