"""Shared pieces of the GPU benchmarks: model shapes, FLOP counts, timing, result lines."""

from __future__ import annotations

import json
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

PEAK_BF16_FLOPS = 989e12  # H100/H200 SXM dense bf16, the MFU denominator

# Qwen3 shapes (random init; embeddings untied as in the feasibility measurements)
SHAPES: dict[str, dict[str, Any]] = {
    "0.6b": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),  # CPU smoke runs of the scripts
    "tiny-gpu": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    ),  # the GPU tests (head_dim 64 suits the bf16 kernels)
    "135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
    ),  # SmolLM2-135M's shape (in the Qwen3 architecture: QK-norm added)
    "1.7b": dict(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    ),
}
VOCAB = 151936


def qwen3_config(shape: str) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=VOCAB,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
        architectures=["Qwen3ForCausalLM"],
        **SHAPES[shape],
    )


def flops_per_token(model: Any, hf_config: Any, *, seq_len: int, training: bool) -> tuple[float, int]:
    """(FLOPs per token, N): 6N + 6 L S d_q for training (2N + 2 L S d_q forward only), where N
    counts parameters without the input embedding (the LM head included) and the attention term
    is QK^T and AV over the causal half of a sequence of `seq_len`."""
    n = sum(p.numel() for name, p in model.named_parameters() if "word_embeddings" not in name)
    d_q = hf_config.num_attention_heads * hf_config.head_dim
    per = 2 * n + 2 * hf_config.num_hidden_layers * seq_len * d_q
    return float(per * (3 if training else 1)), n


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def peak() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def cuda_time(fn: Callable[[], Any], *, warmup: int, repeat: int) -> list[float]:
    """Seconds per call (synchronised wall clock around each call, after warm-up calls)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(result, seconds) of one synchronised call."""
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - start


def median(values: list[float]) -> float:
    return statistics.median(values)


def gib(n_bytes: float) -> float:
    return n_bytes / 2**30


def emit(record: dict[str, Any]) -> None:
    """One JSON result line (prefixed, so logs can be grepped)."""
    print("RESULT " + json.dumps(record), flush=True)


def environment() -> dict[str, Any]:
    import megatron.core
    import transformers

    return {
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "megatron_core": megatron.core.__version__,
        "transformers": transformers.__version__,
    }


# CUDA kernel names by category, first match wins: the profiles of a training step, a decode step,
# the draw and the teacher's scoring
KERNEL_CATEGORIES = [
    ("decode attention", re.compile(r"_decode_attention|partial|combine", re.I)),
    ("attention", re.compile(r"flash|fmha|cudnn|attention|sdpa", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|sm90_|splitk", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor", re.I)),
    ("top-k / sort", re.compile(r"topk|sort|radix", re.I)),
    ("softmax", re.compile(r"softmax", re.I)),
    ("scan (cumsum)", re.compile(r"scan|cumsum", re.I)),
    ("compiled (triton)", re.compile(r"triton", re.I)),
    ("norm", re.compile(r"rms|layer_norm|norm_kernel", re.I)),
    ("reduce", re.compile(r"reduce", re.I)),
    ("copy / cat / fill / index", re.compile(r"copy|memcpy|memset|cat|fill|index|gather|scatter", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled", re.I)),
]


def kernel_category(name: str) -> str:
    """The category of a CUDA kernel's name (`KERNEL_CATEGORIES`), "other" when none matches."""
    for label, pattern in KERNEL_CATEGORIES:
        if pattern.search(name):
            return label
    return "other"
