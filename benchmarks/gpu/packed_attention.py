"""Packed-row attention kernels: forward + backward time and gradient error against float32.

A packed row holds several samples end to end ([t, h, d] with boundaries `cu_seqlens`); attention
must stay inside each sample. Compared, on the Qwen3-1.7B attention shape (16 query heads, 8 KV
heads, head dim 128, bf16):

- `loop_flash`: SDPA (flash) on each sample's slice, one call per sample (what
  `SDPACoreAttention` does for packed rows while training);
- `loop_cudnn_contiguous`: the same loop with cuDNN, each slice copied to contiguous memory first;
- `varlen`: `torch.nn.attention.varlen.varlen_attn` (flash varlen), one call for the whole row.

Errors are max |grad - ref| / max |ref| against a float32 math-kernel reference, per tensor.

    python benchmarks/gpu/packed_attention.py
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.gpu.common import cuda_time, emit, environment, median

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128


def loop(q, k, v, bounds, backends, *, contiguous: bool):
    out = []
    for a, z in zip(bounds[:-1], bounds[1:], strict=True):
        qs, ks, vs = (x[a:z].transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, h, n, d]
        if contiguous:
            qs, ks, vs = qs.contiguous(), ks.contiguous(), vs.contiguous()
        with sdpa_kernel(backends, set_priority=True):
            o = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, enable_gqa=True, scale=1 / math.sqrt(HEAD_DIM)
            )
        out.append(o[0].transpose(0, 1))
    return torch.cat(out, dim=0)


def varlen(q, k, v, bounds):
    from torch.nn.attention.varlen import varlen_attn

    cu = torch.tensor(bounds, dtype=torch.int32, device=q.device)
    longest = max(z - a for a, z in zip(bounds[:-1], bounds[1:], strict=True))
    kwargs = {"scale": 1 / math.sqrt(HEAD_DIM)}
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)  # causal
    else:
        kwargs["is_causal"] = True
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return varlen_attn(q, k, v, cu, cu, longest, longest, **kwargs)


def reference(q, k, v, bounds):
    q, k, v = (x.detach().float().requires_grad_(True) for x in (q, k, v))
    rep = HEADS // KV_HEADS
    out = []
    for a, z in zip(bounds[:-1], bounds[1:], strict=True):
        qs = q[a:z].transpose(0, 1)
        ks = k[a:z].transpose(0, 1).repeat_interleave(rep, 0)
        vs = v[a:z].transpose(0, 1).repeat_interleave(rep, 0)
        with sdpa_kernel([SDPBackend.MATH]):
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=1 / math.sqrt(HEAD_DIM))
        out.append(o.transpose(0, 1))
    return torch.cat(out, dim=0), (q, k, v)


def main() -> None:
    emit({"bench": "environment", **environment()})
    try:
        from torch.nn.attention.varlen import varlen_attn

        emit({"bench": "varlen_signature", "signature": str(inspect.signature(varlen_attn))})
        have_varlen = True
    except ImportError as err:
        emit({"bench": "varlen_signature", "error": str(err)})
        have_varlen = False
    gen = torch.Generator().manual_seed(0)
    mixes = {
        "4 x 4096": [4096] * 4,
        "42 mixed (~390)": torch.randint(150, 630, (42,), generator=gen).tolist(),
    }
    for mix, lengths in mixes.items():
        bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        t = bounds[-1]
        q = torch.randn(t, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(t, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(t, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        upstream = torch.randn(t, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        ref_out, ref_inputs = reference(q, k, v, bounds)
        ref_out.backward(upstream.float())
        ref_grads = [x.grad for x in ref_inputs]
        variants = {
            "loop_flash": lambda: loop(q, k, v, bounds, [SDPBackend.FLASH_ATTENTION], contiguous=False),
            "loop_cudnn_contiguous": lambda: loop(q, k, v, bounds, [SDPBackend.CUDNN_ATTENTION], contiguous=True),
            "loop_cudnn_strided": lambda: loop(q, k, v, bounds, [SDPBackend.CUDNN_ATTENTION], contiguous=False),
        }
        if have_varlen:
            variants["varlen"] = lambda: varlen(q, k, v, bounds)
        for name, fn in variants.items():
            record = {"bench": "packed_attention", "mix": mix, "samples": len(lengths), "tokens": t, "variant": name}
            try:
                for x in (q, k, v):
                    x.grad = None
                out = fn()
                out.backward(upstream)
                scale = lambda ref: float(ref.abs().max())  # noqa: E731
                record["out_err"] = float((out.float() - ref_out).abs().max()) / scale(ref_out)
                record["grad_err_qkv"] = [
                    float((x.grad.float() - g).abs().max()) / scale(g)
                    for x, g in zip((q, k, v), ref_grads, strict=True)
                ]

                def fwd_bwd() -> None:
                    fn().backward(upstream)

                record["fwd_bwd_ms"] = round(1e3 * median(cuda_time(fwd_bwd, warmup=2, repeat=7)), 3)
                with torch.no_grad():
                    record["fwd_ms"] = round(1e3 * median(cuda_time(fn, warmup=2, repeat=7)), 3)
            except RuntimeError as err:  # a kernel that refuses these inputs is a result here
                record["error"] = str(err)[:300]
            emit(record)


if __name__ == "__main__":
    main()
