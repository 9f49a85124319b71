"""A trained Megatron GPTModel written as an HF folder: the weights gathered under HF names on the
device (`export_hf_state`), then copied to the host, serialised once and hashed as they are written
(`write_hf_folder`); `save_megatron_as_hf` is both for one folder.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from tasks.megatron.convert import SUPPORTED_MODEL_TYPES, gather_tensor_parallel_states, megatron_to_hf
from tasks.megatron.side_stream import side_stream

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

logger = logging.getLogger(__name__)


def export_hf_state(model: GPTModel, hf_config: Any) -> dict[str, Tensor] | None:
    """The model's weights under HF names, on the model's device, for the writing rank (tp_rank ==
    dp_rank == 0); None on the others. Collective over the tensor-parallel group.

    The tensors are read-only views for the caller to copy from (slices of one fused tensor share
    storage): `write_hf_folder` writes them, an EMA teacher is updated toward them on the device.
    """
    from megatron.core import parallel_state

    states = gather_tensor_parallel_states(model.state_dict(), on_device=True)
    if parallel_state.get_tensor_model_parallel_rank() != 0 or parallel_state.get_data_parallel_rank() != 0:
        return None
    return megatron_to_hf(states, hf_config)


def write_hf_folder(
    hf_state: Mapping[str, Tensor],
    hf_config: Any,
    out_dir: str | Path,
    *,
    tokenizer: Any | None = None,
    config_dtype: torch.dtype | None = None,
) -> tuple[dict[str, Tensor], str]:
    """Write HF-named weights as an HF folder (config.json + model.safetensors [+ the files of
    `tokenizer`]); returns (the tensors written: CPU copies sharing no storage, the sha256 of the
    weights file).

    The weights file is serialised once in memory and hashed from those bytes as it is written
    (`storage.objects.write_local_hashing`), so its upload need not read it back. config.json
    names `config_dtype` (default: the weights' dtype, which must be one).
    """
    from storage.hashing import write_local_hashing
    from tasks.kept_weights import WEIGHTS_FILE

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # copies of their own: slices of one fused tensor share storage, which safetensors refuses,
    # and the caller keeps these while the model trains on; beside a decode, off its stream
    device = next(iter(hf_state.values())).device
    with side_stream(device):
        tensors = {name: _own_cpu_copy(tensor) for name, tensor in hf_state.items()}
    dtypes = {tensor.dtype for tensor in tensors.values()}
    if len(dtypes) != 1:
        raise ValueError(f"mixed parameter dtypes {sorted(map(str, dtypes))}; cast the model first")
    config = hf_config.__class__.from_dict(hf_config.to_dict())
    config.architectures = [SUPPORTED_MODEL_TYPES[hf_config.model_type]]
    config.dtype = config_dtype or dtypes.pop()
    config.save_pretrained(out)
    # the tensors' own memory, written after the header: no serialised copy (which would also hold
    # the interpreter lock while the next rollout decodes beside this writer)
    digest = write_local_hashing(out / WEIGHTS_FILE, safetensors_buffers(tensors, metadata={"format": "pt"}))
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    logger.info("saved HF model (%d tensors) to %s", len(tensors), out)
    return tensors, digest


# safetensors' names of the dtypes a checkpoint's weights come in
_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def safetensors_buffers(tensors: Mapping[str, Tensor], *, metadata: Mapping[str, str]) -> list[Any]:
    """The bytes of a safetensors file of `tensors` (contiguous CPU tensors of one dtype), as the
    buffers to write one after the other: the header, then each tensor's own memory, in the order
    and with the header `safetensors.torch.save` writes (byte for byte:
    tests/unit/test_safetensors_buffers.py)."""
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) > 1:
        raise ValueError(f"mixed tensor dtypes {sorted(map(str, dtypes))}: safetensors orders them by dtype first")
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    buffers: list[Any] = []
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name]
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"tensor {name!r} must be contiguous on the CPU, is on {tensor.device}")
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
        buffers.append(tensor.reshape(-1).view(torch.uint8).numpy())
    encoded = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    encoded += b" " * (-len(encoded) % 8)
    return [struct.pack("<Q", len(encoded)) + encoded, *buffers]


def save_megatron_as_hf(
    model: GPTModel, hf_config: Any, out_dir: str | Path, *, tokenizer: Any | None = None
) -> dict[str, Tensor] | None:
    """Write the model as an HF folder (config.json + model.safetensors [+ the files of `tokenizer`,
    an HF tokenizer]).

    Collective over the tensor-parallel group; the rank with tp_rank == dp_rank == 0 writes and
    returns the tensors it wrote (HF names, on the CPU, sharing no storage with the model), the
    others return None. The folder loads with `AutoModelForCausalLM.from_pretrained(out_dir)`.
    Weights keep the model's dtype.
    """
    import torch.distributed as dist

    hf_state = export_hf_state(model, hf_config)
    tensors = None if hf_state is None else write_hf_folder(hf_state, hf_config, out_dir, tokenizer=tokenizer)[0]
    if dist.is_initialized():
        dist.barrier()
    return tensors


def _own_cpu_copy(tensor: Tensor) -> Tensor:
    """A contiguous CPU copy with storage of its own (a GPU tensor's copy to the host is one)."""
    tensor = tensor.detach().contiguous()
    return tensor.cpu() if tensor.device.type != "cpu" else tensor.clone()
