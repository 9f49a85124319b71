"""A CUDA stream of its own for the copies a train stage makes while the next rollout decodes.

With pipelined commits (`flows/overlap.py`) the train stage's writers copy the weights to the host,
and a background full-state save stages the optimizer's state there, while the next iteration's
rollout replays its decode graphs. On the device's default stream those copies would queue
between the decode steps and stall them; on a stream of their own, ordered after everything the
default stream had queued when the copy began (the training that produced the tensors), they run
beside the decode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["side_stream"]


@contextlib.contextmanager
def side_stream(device: torch.device) -> Iterator[None]:
    """Run the block's CUDA work on a new stream of `device`, after the current stream's work; on
    another device the block runs as it is."""
    if device.type != "cuda":
        yield
        return
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()
