"""Reducing a per-token loss [B, T] to the scalar of a (micro-)batch under response and sample masks.

The four reductions (`reduction` x `aggregation`) and the whole-batch count that lets micro-batch
losses sum to the batch mean. Shapes: B samples, T response positions (right-padded,
`response_mask` marks real tokens).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Reduction = Literal["exclude", "dilute"]
Aggregation = Literal["token-mean", "sequence-mean"]

_REDUCTIONS = ("exclude", "dilute")
_AGGREGATIONS = ("token-mean", "sequence-mean")


def _check_masks(per_token: Tensor, response_mask: Tensor, sample_mask: Tensor) -> None:
    if per_token.ndim != 2 or response_mask.shape != per_token.shape:
        raise ValueError(
            f"per_token and response_mask must share one [B, T] shape, got {tuple(per_token.shape)} "
            f"and {tuple(response_mask.shape)}"
        )
    if sample_mask.shape != per_token.shape[:1]:
        raise ValueError(f"sample_mask must be [B]={per_token.shape[0]}, got {tuple(sample_mask.shape)}")
    if response_mask.dtype != torch.bool or sample_mask.dtype != torch.bool:
        raise TypeError(f"masks must be bool, got response_mask {response_mask.dtype}, sample_mask {sample_mask.dtype}")


def check_modes(reduction: str, aggregation: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}; expected one of {_REDUCTIONS}")
    if aggregation not in _AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r}; expected one of {_AGGREGATIONS}")


def loss_denominator(
    response_mask: Tensor, sample_mask: Tensor, *, reduction: Reduction, aggregation: Aggregation
) -> Tensor:
    """The count `masked_mean` divides by (float scalar); see `masked_mean` for the four cases.

    When one batch is split into micro-batches whose gradients are summed, compute this once on the
    whole batch's masks and pass it to every micro-batch, so the summed loss equals the whole-batch
    mean.
    """
    check_modes(reduction, aggregation)
    active = response_mask & sample_mask[:, None]  # [B, T]
    if aggregation == "token-mean":
        counted = active if reduction == "exclude" else response_mask
        return counted.sum().to(torch.float32)
    if reduction == "exclude":
        return (active.sum(dim=1) > 0).sum().to(torch.float32)
    return torch.tensor(float(sample_mask.shape[0]))


def masked_mean(
    per_token: Tensor,
    response_mask: Tensor,
    sample_mask: Tensor,
    *,
    reduction: Reduction,
    aggregation: Aggregation,
    denominator: Tensor | float | None = None,
) -> Tensor:
    """Reduce a per-token loss [B, T] to a scalar under the response and per-sample masks.

    A token is active when `response_mask[b, t] and sample_mask[b]`; n_b = sum_t response_mask[b, t].
    With x_bt the per-token value:

    - exclude, token-mean:    sum_active x_bt / #active tokens.
    - dilute, token-mean:     sum_active x_bt / #response tokens of all samples (masked samples add
      zeros to the numerator but keep their tokens in the count).
    - exclude, sequence-mean: mean over active samples (sample_mask and n_b > 0) of
      s_b = sum_t active x_bt / n_b.
    - dilute, sequence-mean:  sum_b s_b / B, where a masked sample has s_b = 0. This is the paper's
      code with one sequence per micro-batch.

    "exclude" keeps the per-token scale fixed as the share of masked samples changes; "dilute" shrinks
    the loss (and so the effective learning rate) when few samples have a teacher. With no active
    token the loss is 0 and its gradient is exactly 0 (never NaN): masked positions are selected
    out, not multiplied by 0, and the denominator is at least 1. `denominator` overrides the count
    (see `loss_denominator`).
    """
    _check_masks(per_token, response_mask, sample_mask)
    check_modes(reduction, aggregation)
    active = response_mask & sample_mask[:, None]  # [B, T]
    values = torch.where(active, per_token, torch.zeros_like(per_token))  # [B, T]
    if aggregation == "token-mean":
        numerator = values.sum()
    else:
        tokens_per_sample = response_mask.sum(dim=1).clamp(min=1).to(values.dtype)  # [B]
        numerator = (values.sum(dim=1) / tokens_per_sample).sum()
    if denominator is None:
        denominator = loss_denominator(response_mask, sample_mask, reduction=reduction, aggregation=aggregation)
    denominator = torch.as_tensor(denominator, dtype=numerator.dtype, device=numerator.device)
    return numerator / denominator.clamp(min=1.0)


def masked_token_mean(values: Tensor, mask: Tensor) -> float:
    """Detached mean of `values` over `mask` as a float (0.0 when the mask is empty), for metrics."""
    count = int(mask.sum())
    return float(torch.where(mask, values.detach(), torch.zeros_like(values)).sum()) / count if count else 0.0
