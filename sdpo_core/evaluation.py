"""Held-out accuracy as the paper reports it: greedy accuracy, avg@n and the unbiased pass@k.

avg@n is the mean over prompts of the fraction of a prompt's n sampled answers that are correct
(the expected accuracy of one sample). pass@k is the probability that at least one of k answers
drawn without replacement from a prompt's n samples is correct, averaged over prompts; with c
correct of n it is 1 - C(n-c, k) / C(n, k), the unbiased estimator of Chen et al. (2021), which
is exact for k = n and equals avg@n for k = 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with `c` correct answers out of `n` samples."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n; got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n (k up to the samples drawn); got n={n}, k={k}")
    if n - c < k:  # every draw of k holds a correct answer
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def k_values(n: int) -> tuple[int, ...]:
    """The k of the pass@k reported for n samples per prompt: the powers of two below n, and n."""
    if n < 1:
        raise ValueError(f"k_values needs n >= 1 samples per prompt; got n={n}")
    ks = []
    k = 1
    while k < n:
        ks.append(k)
        k *= 2
    return (*ks, n)


def accuracy_metrics(
    *,
    greedy_correct: Sequence[bool],
    greedy_lengths: Sequence[int],
    sampled_correct: Sequence[Sequence[bool]],
    sampled_lengths: Sequence[Sequence[int]],
    prefix: str,
) -> dict[str, float]:
    """Greedy accuracy, avg@n, pass@k for `k_values(n)` and mean response lengths of one set of prompts.

    `greedy_correct[i]` is prompt i's greedy answer; `sampled_correct[i]` its n sampled answers (the
    same n for every prompt). Keys are `prefix` + `greedy_accuracy`, `avg_at_<n>`, `pass_at_<k>`,
    `response_length_mean` (greedy), `sampled_response_length_mean`, `prompts`.
    """
    prompts = len(greedy_correct)
    if prompts == 0:
        raise ValueError("accuracy_metrics needs at least one prompt")
    if not len(greedy_lengths) == len(sampled_correct) == len(sampled_lengths) == prompts:
        raise ValueError(
            f"one entry per prompt: {prompts} greedy answers, {len(greedy_lengths)} greedy lengths, "
            f"{len(sampled_correct)} sampled groups, {len(sampled_lengths)} sampled length groups"
        )
    sizes = {len(group) for group in sampled_correct} | {len(group) for group in sampled_lengths}
    if len(sizes) != 1:
        raise ValueError(f"every prompt needs the same number of sampled answers; got group sizes {sorted(sizes)}")
    (n,) = sizes
    counts = [sum(bool(x) for x in group) for group in sampled_correct]
    metrics = {
        f"{prefix}greedy_accuracy": sum(bool(x) for x in greedy_correct) / prompts,
        f"{prefix}avg_at_{n}": sum(counts) / (n * prompts),
        f"{prefix}response_length_mean": sum(greedy_lengths) / prompts,
        f"{prefix}sampled_response_length_mean": sum(sum(group) for group in sampled_lengths) / (n * prompts),
        f"{prefix}prompts": float(prompts),
    }
    for k in k_values(n):
        metrics[f"{prefix}pass_at_{k}"] = sum(pass_at_k(n, c, k) for c in counts) / prompts
    return metrics
