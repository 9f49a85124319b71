"""The SDPO loss on [T, V] bf16 student logits: chunked top-K + tail against the naive full-vocabulary JSD.

Every variant runs forward + backward to the logits gradient (which is counted in its memory).
- full_naive: float32 log_softmax over V for student and teacher, generalized JSD over V.
- topk_naive: exact student log-probs on the K ids via a float32 [T, V] log_softmax, tail bucket,
  JSD over K+1 buckets (teacher top-K log-probs given).
- topk_chunked[_compiled]: the same loss with `sdpo_core.chunked.chunked_token_logprobs`.

    python benchmarks/gpu/loss_kernel.py [--tokens 8192] [--k 100]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.gpu.common import DEVICE, VOCAB, allocated, cuda_time, emit, gib, median, peak, reset_peak, sync
from sdpo_core.chunked import chunked_token_logprobs, reference_token_logprobs
from sdpo_core.divergence import full_vocab_divergence, topk_divergence


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    t, v, k = args.tokens, args.vocab, args.k
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    student = (torch.randn(t, v, device=DEVICE, generator=gen) * 2).to(torch.bfloat16).requires_grad_(True)
    teacher = (student.detach().float() + torch.randn(t, v, device=DEVICE, generator=gen)).to(torch.bfloat16)
    ids = torch.topk(student.detach(), k, dim=-1).indices  # [T, K]
    teacher_topk = torch.log_softmax(teacher.float(), -1).gather(-1, ids)  # [T, K]
    rows = torch.arange(t, device=DEVICE)

    def full_naive() -> torch.Tensor:
        return full_vocab_divergence(student, teacher, alpha=0.5).mean()

    def topk_naive() -> torch.Tensor:
        return topk_divergence(reference_token_logprobs(student, rows, ids), teacher_topk, alpha=0.5, tail=True).mean()

    def topk_chunked(compile: bool, chunk: int):
        def loss() -> torch.Tensor:
            lp = chunked_token_logprobs(student, rows, ids, chunk_tokens=chunk, compile=compile)
            return topk_divergence(lp, teacher_topk, alpha=0.5, tail=True).mean()

        return loss

    variants = {
        "full_naive": full_naive,
        "topk_naive": topk_naive,
        "topk_chunked_eager_1024": topk_chunked(False, 1024),
    }
    if DEVICE == "cuda":  # the CPU smoke run stays eager
        variants["topk_chunked_compiled_1024"] = topk_chunked(True, 1024)
        variants["topk_chunked_compiled_2048"] = topk_chunked(True, 2048)
        variants["topk_chunked_compiled_4096"] = topk_chunked(True, 4096)
    reference_grad = None
    results = {}
    for name, loss_fn in variants.items():

        def step() -> float:
            student.grad = None
            loss = loss_fn()
            loss.backward()
            return loss

        times = cuda_time(step, warmup=2, repeat=args.repeat)
        student.grad = None
        sync()
        reset_peak()
        base = allocated()
        loss = step()
        sync()
        extra = peak() - base
        grad = student.grad.float()[::16]
        if name == "topk_naive":
            reference_grad = grad
        err = None
        if reference_grad is not None and name.startswith("topk"):
            err = float((grad - reference_grad).norm() / reference_grad.norm())
        results[name] = {"ms": median(times) * 1e3, "extra_gib": gib(extra), "loss": float(loss)}
        emit(
            {
                "bench": "loss_kernel",
                "variant": name,
                "tokens": t,
                "vocab": v,
                "k": k,
                "ms_median": round(median(times) * 1e3, 3),
                "ms_min": round(min(times) * 1e3, 3),
                "extra_gib": round(gib(extra), 3),
                "loss": float(loss),
                "grad_rel_err_vs_topk_naive": err,
            }
        )
    naive = results["full_naive"]
    for name, best in results.items():
        if name.startswith("topk_chunked"):
            emit(
                {
                    "bench": "loss_kernel_ratio",
                    "variant": name,
                    "time_ratio_vs_full_naive": round(best["ms"] / naive["ms"], 4),
                    "memory_ratio_vs_full_naive": round(best["extra_gib"] / max(naive["extra_gib"], 1e-12), 4),
                    "goal": "time <= 0.1, memory <= 1/15 = 0.0667",
                }
            )


if __name__ == "__main__":
    main()
