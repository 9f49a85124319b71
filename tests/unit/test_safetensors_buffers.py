"""The train stage writes safetensors files from the tensors' own memory: the same bytes as safetensors."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors.torch import load, save

from storage.hashing import write_local_hashing
from tasks.megatron.hf_export import safetensors_buffers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_the_buffers_are_the_bytes_safetensors_writes(tmp_path, dtype):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "model.layers.1.mlp.weight": torch.randn(33, 17, generator=gen).to(dtype),
        "model.embed_tokens.weight": torch.randn(101, 8, generator=gen).to(dtype),
        "lm_head.weight": torch.randn(7, generator=gen).to(dtype),
        "a.scalar": torch.tensor(3.0).to(dtype),
        "b.empty": torch.zeros(0, 4).to(dtype),
        "model.layers.10.x": torch.randn(3, 2, 2, generator=gen).to(dtype),
    }
    want = save(tensors, metadata={"format": "pt"})
    got = b"".join(bytes(memoryview(b).cast("B")) for b in safetensors_buffers(tensors, metadata={"format": "pt"}))
    assert got == want
    path = tmp_path / "model.safetensors"
    assert (
        write_local_hashing(path, safetensors_buffers(tensors, metadata={"format": "pt"}))
        == hashlib.sha256(want).hexdigest()
    )
    assert path.read_bytes() == want
    assert all(torch.equal(load(want)[k], v) for k, v in tensors.items())


def test_mixed_dtypes_and_strided_tensors_are_refused():
    with pytest.raises(ValueError, match="mixed tensor dtypes"):
        safetensors_buffers({"a": torch.zeros(2), "b": torch.zeros(2, dtype=torch.bfloat16)}, metadata={})
    with pytest.raises(ValueError, match="must be contiguous"):
        safetensors_buffers({"a": torch.zeros(4, 4).t()}, metadata={})
