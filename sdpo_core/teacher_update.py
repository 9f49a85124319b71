"""Teacher regularisation: the EMA teacher and the trust-region teacher.

The rate tau is the weight of the *student* in the update (small, 0.01-0.05): a tau near 1 makes the
teacher follow the student, a tau near 0 keeps it at its initial weights.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check_rate(rate: float) -> None:
    if not 0.0 < rate <= 1.0:
        raise ValueError(
            f"teacher update rate tau={rate} is outside (0, 1]; it is the student's weight in "
            "(1 - tau) * teacher + tau * student (the paper uses 0.05, 0.01 for code)"
        )


@torch.no_grad()
def ema_update_(teacher: dict[str, Tensor], student: dict[str, Tensor], *, rate: float) -> None:
    """In place: theta_T <- (1 - tau) * theta_T + tau * theta for every floating tensor.

    Both dicts must hold the same names with the same shapes. The student's tensor is cast to the
    teacher's dtype and device first (keep the teacher in float32 for small tau: in bfloat16 an update
    of 1% of a weight's distance is mostly rounded away). Integer and boolean buffers (counters,
    masks) are copied. tau = 1 copies exactly.
    """
    _check_rate(rate)
    missing, extra = sorted(teacher.keys() - student.keys()), sorted(student.keys() - teacher.keys())
    if missing or extra:
        raise ValueError(f"teacher and student state differ: only in teacher {missing}, only in student {extra}")
    for name, target in teacher.items():
        source = student[name]
        if source.shape != target.shape:
            raise ValueError(f"{name}: teacher shape {tuple(target.shape)} != student shape {tuple(source.shape)}")
        source = source.to(device=target.device, dtype=target.dtype)
        if rate == 1.0 or not target.dtype.is_floating_point:
            target.copy_(source)
        else:
            target.lerp_(source, rate)


def trust_region_logits(ref_logits: Tensor, student_logits: Tensor, *, rate: float) -> Tensor:
    """Teacher logits (1 - tau) * z_ref + tau * z_theta, both scored on the teacher's context: [..., V].

    z_ref comes from the frozen initial model, z_theta from the current student; the result is used as
    the teacher and is detached by the divergence, so no gradient flows through it there.
    """
    _check_rate(rate)
    if ref_logits.shape != student_logits.shape:
        raise ValueError(
            f"ref_logits {tuple(ref_logits.shape)} and student_logits {tuple(student_logits.shape)} differ in shape"
        )
    return torch.lerp(ref_logits, student_logits.to(ref_logits.dtype), rate)
