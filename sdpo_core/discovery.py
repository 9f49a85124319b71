"""discovery@k: the chance of having found a correct answer to one question within k attempts.

Test-time self-distillation attacks a single hard question: each iteration makes G attempts, and
SDPO updates the policy on that question between iterations. For one (question, seed) sequence of
attempts, the first success is the 1-based index of the first correct attempt in the order the
attempts were made (iteration by iteration); discovery@k over many sequences is the fraction whose
first success came at or before attempt k.

The baseline makes the same number of attempts without updates (best-of-k from the base policy):
with c correct among n independent samples of a question, its discovery@k is the unbiased pass@k,
1 - C(n-c, k) / C(n, k), averaged over questions.
"""

from __future__ import annotations

from collections.abc import Sequence

from sdpo_core.evaluation import pass_at_k


def first_success(rewards: Sequence[Sequence[float]], *, threshold: float = 1.0) -> int | None:
    """The 1-based attempt index of the first reward >= `threshold`, attempts counted in order over
    the iterations' reward lists; None when no attempt succeeded."""
    made = 0
    for iteration_rewards in rewards:
        for reward in iteration_rewards:
            made += 1
            if reward >= threshold:
                return made
    return None


def discovery_at_k(first_successes: Sequence[int | None], ks: Sequence[int]) -> list[float]:
    """For each k, the fraction of attempt sequences whose first success is at attempt <= k.

    A sequence that found nothing (None) counts as not discovered at every k; every sequence must
    have had at least max(ks) attempts for the fraction to mean discovery@k (the caller's budget).
    """
    if not first_successes:
        raise ValueError("discovery_at_k needs at least one attempt sequence")
    bad = [f for f in first_successes if f is not None and f < 1]
    if bad or any(k < 1 for k in ks):
        raise ValueError(f"attempt indices and k are 1-based; got first successes {bad} and ks {list(ks)}")
    total = len(first_successes)
    return [sum(1 for f in first_successes if f is not None and f <= k) / total for k in ks]


def best_of_k_discovery(successes: Sequence[int], *, n: int, ks: Sequence[int]) -> list[float]:
    """For each k, the mean over questions of the unbiased pass@k of `successes[q]` correct answers
    among `n` samples of question q (k up to n)."""
    if not successes:
        raise ValueError("best_of_k_discovery needs at least one question")
    return [sum(pass_at_k(n, c, k) for c in successes) / len(successes) for k in ks]


def attempt_grid(max_attempts: int, group_size: int) -> tuple[int, ...]:
    """The k at which the curves are reported: every iteration boundary (multiples of the group size)
    up to `max_attempts`, and `max_attempts` itself."""
    if max_attempts < 1 or group_size < 1:
        raise ValueError(f"attempt_grid needs max_attempts >= 1 and group_size >= 1; got {max_attempts}, {group_size}")
    ks = list(range(group_size, max_attempts, group_size))
    return (*ks, max_attempts)
