"""Weights on the SDPO term: SRPO's teacher-entropy token weights and the pass-rate question weights.

Both are constants of the loss (no gradient flows through them) and both are normalised to mean 1
over the batch's SDPO-trained elements, so they reshape where the SDPO loss puts its weight without
changing its overall scale:

- Entropy weights (SRPO): w_t = exp(-beta * H_t) / mean(exp(-beta * H)), H_t the self-teacher's
  next-token entropy over the full vocabulary (nats), the mean taken over the batch's tokens routed
  to SDPO. Confident teacher tokens count more than tokens where the teacher hesitates; beta = 0
  gives w_t = 1.
- Question weights (pass-rate weighted SDPO): q_b = sqrt(p_b (1 - p_b)) / mean(sqrt(p (1 - p))),
  p_b the pass rate of the sample's question, the mean taken over the batch's SDPO-trained samples.
  The estimator of p is the group's share of successes, the sample itself included (see
  `sdpo_core.routing.pass_rates`): for 0/1 rewards sqrt(p (1 - p)) is then exactly the group's
  reward standard deviation (the population form), the per-question scale that GRPO's advantage
  normalisation divides away and SDPO lacks. A question every sample solves (p = 1) or none does
  (p = 0) gets weight 0; when every SDPO sample of the batch has weight 0, so does the whole term.

"The batch" is what one optimizer step averages over: with micro-batches, compute the norm on the
whole mini-batch (`weight_norm`) and pass it to every micro-batch, as with the loss denominators.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _float(tensor: Tensor) -> Tensor:
    """Detached, in float32 (half types) or float64 (kept: the tests compare in float64)."""
    return tensor.detach().to(torch.promote_types(tensor.dtype, torch.float32))


def entropy_weights(teacher_entropy: Tensor, *, beta: float) -> Tensor:
    """Unnormalised SRPO token weights exp(-beta * H): any shape -> the same shape, detached.

    Raises for a negative or non-finite beta and for a NaN or negative entropy (beyond float
    round-off of 1e-3 nats), which would mean the teacher stage stored something else.
    """
    if not math.isfinite(beta) or beta < 0:
        raise ValueError(f"beta={beta}; the entropy weight exp(-beta * H) needs a finite beta >= 0 (SRPO uses 1)")
    entropy = _float(teacher_entropy)
    bad = torch.isnan(entropy) | (entropy < -1e-3)
    if bool(bad.any()):
        raise ValueError(f"teacher entropies must be >= 0 nats, got {entropy[bad][:8].tolist()}")
    return torch.exp(-beta * entropy.clamp(min=0.0))


def question_weights(pass_rate: Tensor) -> Tensor:
    """Unnormalised pass-rate question weights sqrt(p (1 - p)): any shape -> the same shape, detached."""
    p = _float(pass_rate)
    bad = torch.isnan(p) | (p < 0) | (p > 1)
    if bool(bad.any()):
        raise ValueError(f"pass rates must lie in [0, 1], got {p[bad][:8].tolist()}")
    return (p * (1.0 - p)).clamp(min=0.0).sqrt()


def weight_norm(weights: Tensor, mask: Tensor) -> Tensor:
    """The mean of `weights` over `mask` (same shape, bool), a float scalar; 0 when the mask is empty."""
    if weights.shape != mask.shape or mask.dtype != torch.bool:
        raise ValueError(
            f"weights {tuple(weights.shape)} need a bool mask of the same shape, got {mask.dtype} {tuple(mask.shape)}"
        )
    count = mask.sum()
    total = torch.where(mask, weights, torch.zeros_like(weights)).sum()
    return total / count.clamp(min=1).to(total.dtype)


def normalised(weights: Tensor, mask: Tensor, *, norm: Tensor | float | None) -> Tensor:
    """`weights / norm` on `mask` and 0 elsewhere; `norm` defaults to `weight_norm(weights, mask)`.

    A norm of 0 (every weight on the mask is 0) gives all zeros, never NaN.
    """
    if norm is None:
        norm = weight_norm(weights, mask)
    norm = torch.as_tensor(norm, dtype=weights.dtype, device=weights.device)
    if bool(norm < 0) or not bool(torch.isfinite(norm)):
        raise ValueError(f"a weight norm must be finite and >= 0, got {float(norm)}")
    scaled = weights / torch.where(norm > 0, norm, torch.ones_like(norm))
    keep = mask & (norm > 0)
    return torch.where(keep, scaled, torch.zeros_like(scaled))
