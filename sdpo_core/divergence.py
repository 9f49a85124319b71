"""Per-token divergences between the student p and the (stop-gradient) teacher q.

Conventions (those of the paper's code; Relax numbers the endpoints the other way round):

- alpha = 0: forward KL(q || p), the teacher is the target (mode covering).
- alpha = 1: reverse KL(p || q), what the sampled-token loss estimates.
- 0 < alpha < 1: with the mixture m = (1 - alpha) * p + alpha * q,
  D_alpha = (1 - alpha) * KL(p || m) + alpha * KL(q || m); alpha = 0.5 is the Jensen-Shannon
  divergence. This expression tends to 0 at both ends, which is why the endpoints are special cases.

Every function takes log-probabilities or logits on the last axis and returns one value per token.
The teacher is detached inside, so gradients reach only the student (also through the mixture).
Half-precision inputs are computed in float32; the result has that compute dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

# Below this a log-probability is an exact zero probability in every float dtype (exp underflows).
# Flooring -inf there keeps zero-probability entries at a zero contribution with finite gradients.
_LOGPROB_FLOOR = -1.0e4

TAIL_EPS = 1e-7
"""The top-K mass is capped at exp(-TAIL_EPS) before the tail bucket log(1 - sum p) is taken."""


def _compute_dtype(tensor: Tensor) -> Tensor:
    if tensor.dtype in (torch.float16, torch.bfloat16):
        return tensor.float()
    return tensor


def _check_alpha(alpha: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha} is outside [0, 1] (0 = KL(teacher||student), 1 = KL(student||teacher))")


def _check_same_shape(student: Tensor, teacher: Tensor, *, what: str) -> None:
    if student.shape != teacher.shape:
        raise ValueError(f"{what}: student shape {tuple(student.shape)} != teacher shape {tuple(teacher.shape)}")


def _kl(log_a: Tensor, log_b: Tensor) -> Tensor:
    """KL(a || b) = sum_v a(v) (log a(v) - log b(v)) over the last axis, from log-probabilities."""
    return (log_a.exp() * (log_a - log_b)).sum(dim=-1)


def add_tail_bucket(logprobs: Tensor, *, eps: float = TAIL_EPS) -> Tensor:
    """Append log(1 - sum_k p_k) as a (K+1)-th bucket: [..., K] -> [..., K+1].

    `logprobs` are full-vocabulary log-probabilities of K ids, so their mass is at most 1. The tail
    is log(-expm1(min(logsumexp(logprobs), -eps))): expm1 keeps precision when the top-K mass is
    close to 1, and the cap keeps the value (about log(eps)) and its gradient finite when the mass
    reaches 1 in floating point.
    """
    logprobs = _compute_dtype(logprobs)
    log_mass = torch.logsumexp(logprobs, dim=-1, keepdim=True)  # [..., 1]
    tail = torch.log(-torch.expm1(torch.clamp(log_mass, max=-eps)))  # [..., 1]
    return torch.cat([logprobs, tail], dim=-1)


def generalized_jsd(student_logprobs: Tensor, teacher_logprobs: Tensor, *, alpha: float) -> Tensor:
    """D_alpha between two normalised distributions given as log-probabilities on the last axis.

    [..., V] x [..., V] -> [...]. See the module docstring for the alpha convention. The mixture is
    formed in log space (logaddexp of log weight + log-probability), so it never underflows.
    """
    _check_alpha(alpha)
    _check_same_shape(student_logprobs, teacher_logprobs, what="generalized_jsd")
    log_p = _compute_dtype(student_logprobs).clamp(min=_LOGPROB_FLOOR)
    log_q = _compute_dtype(teacher_logprobs).detach().clamp(min=_LOGPROB_FLOOR)
    if alpha == 0.0:
        return _kl(log_q, log_p)
    if alpha == 1.0:
        return _kl(log_p, log_q)
    log_m = torch.logaddexp(log_p + math.log(1.0 - alpha), log_q + math.log(alpha))  # [..., V]
    return (1.0 - alpha) * _kl(log_p, log_m) + alpha * _kl(log_q, log_m)


def topk_divergence(student_logprobs: Tensor, teacher_logprobs: Tensor, *, alpha: float, tail: bool) -> Tensor:
    """D_alpha on the student's top-K ids: [..., K] x [..., K] -> [...].

    Both inputs are full-vocabulary log-probabilities of the same K token ids. With `tail`, each side
    gets the (K+1)-th bucket of `add_tail_bucket`, so the divergence also sees the mass outside the
    top-K; without it, both sides are renormalised over the K ids.
    """
    _check_same_shape(student_logprobs, teacher_logprobs, what="topk_divergence")
    teacher_logprobs = teacher_logprobs.detach()
    if tail:
        student = add_tail_bucket(student_logprobs)
        teacher = add_tail_bucket(teacher_logprobs)
    else:
        student = torch.log_softmax(_compute_dtype(student_logprobs), dim=-1)
        teacher = torch.log_softmax(_compute_dtype(teacher_logprobs), dim=-1)
    return generalized_jsd(student, teacher, alpha=alpha)


def full_vocab_divergence(student_logits: Tensor, teacher_logits: Tensor, *, alpha: float) -> Tensor:
    """D_alpha over the whole vocabulary from logits: [..., V] x [..., V] -> [...]."""
    _check_same_shape(student_logits, teacher_logits, what="full_vocab_divergence")
    student = F.log_softmax(_compute_dtype(student_logits), dim=-1)
    teacher = F.log_softmax(_compute_dtype(teacher_logits.detach()), dim=-1)
    return generalized_jsd(student, teacher, alpha=alpha)


def sampled_token_advantage(student_logprob: Tensor, teacher_logprob: Tensor) -> Tensor:
    """Per-token advantage log q(y_t) - log p(y_t) of the sampled token, detached: [...] -> [...]."""
    _check_same_shape(student_logprob, teacher_logprob, what="sampled_token_advantage")
    return (_compute_dtype(teacher_logprob) - _compute_dtype(student_logprob)).detach()


def sampled_token_loss(student_logprob: Tensor, teacher_logprob: Tensor) -> Tensor:
    """REINFORCE surrogate l_t = sg(log p(y_t) - log q(y_t)) * log p(y_t): [...] -> [...].

    Its gradient, -A_t * grad log p(y_t) with A_t = log q(y_t) - log p(y_t), is the single-sample
    estimate of the gradient of KL(p || q) when y_t is drawn from p, so it is defined for alpha = 1
    only. The value itself is a surrogate, not a divergence; log p - log q estimates the divergence.
    """
    advantage = sampled_token_advantage(student_logprob, teacher_logprob)
    return -advantage * _compute_dtype(student_logprob)
