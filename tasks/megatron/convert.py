"""Hugging Face <-> Megatron-core weight conversion for Llama, Qwen2 and Qwen3.

The state-dict conversion (`hf_to_megatron`, `megatron_to_hf`) is pure torch: name tables plus
two fused layouts, and the tensor-parallel slicing. Megatron's local-spec GPTModel differs from
the HF layout in two places:

- Attention: one `linear_qkv` whose output rows are grouped per query group:
  for each KV group g, the rows of its query heads, then its key head, then its value head.
  A tensor-parallel rank holds a contiguous run of whole groups.
- MLP: one `linear_fc1` = [gate; up]. Under tensor parallelism each rank holds
  [its gate shard; its up shard].

Row-parallel weights (`linear_proj`, `linear_fc2`) split on the input dim (1); column-parallel
ones on the output dim (0); the embedding and output layer split the vocabulary (dim 0) after
padding it to a multiple of the tensor-parallel size. This is Megatron's
`make_vocab_size_divisible_by=1` choice: no padding at all for TP=1, and none for vocabularies
that are already multiples (Qwen's 151936, Llama-3's 128256). Padded rows are zeros, so padded
logits are 0: slice logits to the HF vocab size before any softmax.

`load_hf_into_megatron` wraps these for a built model and an HF folder; `tasks/megatron/hf_export.py`
writes a built model as one.

One module on purpose (longer than most): the two directions are inverse tables of one layout, and
reading them side by side is how a change to one is checked against the other.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

logger = logging.getLogger(__name__)

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "check_supported_config",
    "head_dim_of",
    "padded_vocab_size",
    "interleave_qkv",
    "split_qkv",
    "hf_to_megatron",
    "megatron_to_hf",
    "gather_tensor_parallel_states",
    "load_hf_into_megatron",
    "load_hf_state_into_megatron",
]

# HF `model_type` -> the causal-LM class it names in `config.architectures`.
SUPPORTED_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# Split kinds: how a tensor is divided across tensor-parallel ranks.
_REPLICATED = "replicated"
_COLUMN = "column"  # output dim (0)
_ROW = "row"  # input dim (1)
_VOCAB = "vocab"  # dim 0 after vocabulary padding
_QKV = "qkv"  # dim 0 of the group-interleaved tensor
_FC1 = "fc1"  # gate and up each split on dim 0, then concatenated

# One-to-one names inside a decoder layer: HF suffix -> (Megatron suffix, split kind).
_LAYER_NAMES = {
    "input_layernorm.weight": ("input_layernorm.weight", _REPLICATED),
    "post_attention_layernorm.weight": ("pre_mlp_layernorm.weight", _REPLICATED),
    "self_attn.q_norm.weight": ("self_attention.q_layernorm.weight", _REPLICATED),
    "self_attn.k_norm.weight": ("self_attention.k_layernorm.weight", _REPLICATED),
    "self_attn.o_proj.weight": ("self_attention.linear_proj.weight", _ROW),
    "mlp.down_proj.weight": ("mlp.linear_fc2.weight", _ROW),
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": ("embedding.word_embeddings.weight", _VOCAB),
    "model.norm.weight": ("decoder.final_layernorm.weight", _REPLICATED),
    "lm_head.weight": ("output_layer.weight", _VOCAB),
}


def check_supported_config(hf_config: Any) -> str:
    """Return `hf_config.model_type`, or raise naming the architecture and the unmapped feature."""
    model_type = hf_config.model_type
    architectures = hf_config.architectures or []
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"architecture {architectures or model_type!r} (model_type={model_type!r}) has no "
            f"Megatron mapping; supported: {sorted(SUPPORTED_MODEL_TYPES.values())}"
        )
    expected = SUPPORTED_MODEL_TYPES[model_type]
    if architectures and architectures != [expected]:
        raise NotImplementedError(
            f"architecture {architectures} has no Megatron mapping; for model_type="
            f"{model_type!r} only {expected} is supported"
        )
    if hf_config.hidden_act != "silu":
        raise NotImplementedError(f"{expected}: hidden_act={hf_config.hidden_act!r}, only 'silu'")
    if model_type in ("llama", "qwen3") and hf_config.attention_bias:
        raise NotImplementedError(f"{expected}: attention_bias=True (biases on q/k/v and o_proj) is not mapped")
    if model_type == "llama" and hf_config.mlp_bias:
        raise NotImplementedError(f"{expected}: mlp_bias=True is not mapped")
    if model_type in ("qwen2", "qwen3"):
        if hf_config.use_sliding_window:
            raise NotImplementedError(f"{expected}: use_sliding_window=True is not mapped")
        layer_types = set(hf_config.layer_types or ["full_attention"])
        if layer_types != {"full_attention"}:
            raise NotImplementedError(f"{expected}: layer_types {sorted(layer_types)} not mapped")
    return model_type


def head_dim_of(hf_config: Any) -> int:
    """Per-head width: `head_dim` when the config sets it (Qwen3 decouples it), else H / heads."""
    if hf_config.head_dim is not None:
        return int(hf_config.head_dim)
    return hf_config.hidden_size // hf_config.num_attention_heads


def padded_vocab_size(vocab_size: int, *, tensor_parallel: int) -> int:
    """The vocabulary rounded up to a multiple of the tensor-parallel size."""
    return -(-vocab_size // tensor_parallel) * tensor_parallel


@dataclass(frozen=True)
class _Shape:
    """The facts of an HF config the conversion needs."""

    model_type: str
    num_layers: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    tied: bool

    @classmethod
    def of(cls, hf_config: Any) -> _Shape:
        model_type = check_supported_config(hf_config)
        return cls(
            model_type=model_type,
            num_layers=hf_config.num_hidden_layers,
            num_heads=hf_config.num_attention_heads,
            num_query_groups=hf_config.num_key_value_heads,
            head_dim=head_dim_of(hf_config),
            vocab_size=hf_config.vocab_size,
            tied=bool(hf_config.tie_word_embeddings),
        )

    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    def global_names(self) -> dict[str, tuple[str, str]]:
        names = dict(_GLOBAL_NAMES)
        if self.tied:
            del names["lm_head.weight"]
        return names

    def layer_names(self) -> dict[str, tuple[str, str]]:
        names = dict(_LAYER_NAMES)
        if not self.qk_norm:
            del names["self_attn.q_norm.weight"], names["self_attn.k_norm.weight"]
        return names

    def qkv_params(self) -> list[str]:
        return ["weight", "bias"] if self.qkv_bias else ["weight"]


def interleave_qkv(q: Tensor, k: Tensor, v: Tensor, *, num_query_groups: int, head_dim: int) -> Tensor:
    """HF q/k/v projections (weights [out, H] or biases [out]) -> Megatron's `linear_qkv`."""
    rest = q.shape[1:]
    q = q.reshape(num_query_groups, -1, *rest)  # [G, heads_per_group * hd, ...]
    k = k.reshape(num_query_groups, head_dim, *rest)  # [G, hd, ...]
    v = v.reshape(num_query_groups, head_dim, *rest)  # [G, hd, ...]
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: Tensor, *, num_heads: int, num_query_groups: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `interleave_qkv`: Megatron's `linear_qkv` (full, all ranks) -> HF q, k, v."""
    rest = qkv.shape[1:]
    q_rows = num_heads // num_query_groups * head_dim
    grouped = qkv.reshape(num_query_groups, q_rows + 2 * head_dim, *rest)
    q, k, v = grouped.split([q_rows, head_dim, head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _shard(tensor: Tensor, *, dim: int, tp_rank: int, tp_size: int, name: str) -> Tensor:
    if tensor.shape[dim] % tp_size:
        raise ValueError(f"{name}: dim {dim} of shape {tuple(tensor.shape)} is not divisible by tp_size={tp_size}")
    return tensor.chunk(tp_size, dim=dim)[tp_rank]


def _pad_vocab(tensor: Tensor, padded: int) -> Tensor:
    if tensor.shape[0] == padded:
        return tensor
    pad = tensor.new_zeros(padded - tensor.shape[0], *tensor.shape[1:])
    return torch.cat([tensor, pad], dim=0)


def hf_to_megatron(
    hf_state: Mapping[str, Tensor], hf_config: Any, *, tp_rank: int = 0, tp_size: int = 1
) -> dict[str, Tensor]:
    """An HF causal-LM state dict -> the Megatron GPTModel state dict of one tensor-parallel rank.

    Every HF weight must be consumed: leftover keys (an unmapped feature) raise, and so do
    missing ones. With tied embeddings an `lm_head.weight` entry, if present, is ignored.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} is outside tp_size={tp_size}")
    shape = _Shape.of(hf_config)
    todo = dict(hf_state)
    if shape.tied:
        todo.pop("lm_head.weight", None)
    missing: list[str] = []

    def take(name: str) -> Tensor:
        if name not in todo:
            missing.append(name)
            return torch.empty(0)
        return todo.pop(name)

    def to_rank(tensor: Tensor, kind: str, name: str) -> Tensor:
        if not tensor.numel():  # missing; reported below
            return tensor
        if kind == _VOCAB:
            padded = padded_vocab_size(shape.vocab_size, tensor_parallel=tp_size)
            tensor = _pad_vocab(tensor, padded)
        if kind == _REPLICATED:
            return tensor
        dim = 1 if kind == _ROW else 0
        return _shard(tensor, dim=dim, tp_rank=tp_rank, tp_size=tp_size, name=name)

    out: dict[str, Tensor] = {}
    for hf_name, (mc_name, kind) in shape.global_names().items():
        out[mc_name] = to_rank(take(hf_name), kind, mc_name)
    for layer in range(shape.num_layers):
        hf_prefix, mc_prefix = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        for hf_name, (mc_name, kind) in shape.layer_names().items():
            name = mc_prefix + mc_name
            out[name] = to_rank(take(hf_prefix + hf_name), kind, name)
        for param in shape.qkv_params():
            name = f"{mc_prefix}self_attention.linear_qkv.{param}"
            q, k, v = (take(f"{hf_prefix}self_attn.{p}_proj.{param}") for p in "qkv")
            if q.numel() and k.numel() and v.numel():
                qkv = interleave_qkv(q, k, v, num_query_groups=shape.num_query_groups, head_dim=shape.head_dim)
                out[name] = to_rank(qkv, _QKV, name)
        name = f"{mc_prefix}mlp.linear_fc1.weight"
        gate, up = take(f"{hf_prefix}mlp.gate_proj.weight"), take(f"{hf_prefix}mlp.up_proj.weight")
        if gate.numel() and up.numel():
            out[name] = torch.cat([to_rank(gate, _COLUMN, name), to_rank(up, _COLUMN, name)])
    leftover = sorted(name for name in todo if not name.endswith("rotary_emb.inv_freq"))
    if missing or leftover:
        raise ValueError(
            f"HF state does not match {SUPPORTED_MODEL_TYPES[shape.model_type]}: "
            f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unmapped {leftover[:8]}{'...' if len(leftover) > 8 else ''}"
        )
    return out


def _kind_of(mc_name: str) -> str:
    """The split kind of a Megatron parameter name."""
    if ".linear_qkv." in mc_name:
        return _QKV
    if ".linear_fc1." in mc_name:
        return _FC1
    suffix = mc_name.split(".", 3)[3] if mc_name.startswith("decoder.layers.") else mc_name
    for mc_suffix, kind in list(_LAYER_NAMES.values()) + list(_GLOBAL_NAMES.values()):
        if suffix == mc_suffix:
            return kind
    raise KeyError(f"no tensor-parallel layout known for Megatron parameter {mc_name!r}")


def _merge_ranks(name: str, shards: list[Tensor]) -> Tensor:
    """One full tensor from its per-rank shards."""
    if len(shards) == 1:
        return shards[0]
    kind = _kind_of(name)
    if kind == _REPLICATED:
        for rank, shard in enumerate(shards[1:], start=1):
            if not torch.equal(shard, shards[0]):
                raise ValueError(f"{name} is replicated but differs between tp rank 0 and {rank}")
        return shards[0]
    if kind == _ROW:
        return torch.cat(shards, dim=1)
    if kind in (_VOCAB, _QKV):
        return torch.cat(shards, dim=0)
    # _FC1: every rank holds [gate shard; up shard].
    gates, ups = zip(*(shard.chunk(2, dim=0) for shard in shards), strict=True)
    return torch.cat([*gates, *ups], dim=0)


def megatron_to_hf(
    mcore_states: Mapping[str, Tensor] | Sequence[Mapping[str, Tensor]], hf_config: Any
) -> dict[str, Tensor]:
    """Megatron GPTModel state dict(s) -> an HF causal-LM state dict (the keys HF would save).

    Pass one state dict for TP=1, or the list of all tensor-parallel ranks' state dicts in rank
    order. `_extra_state` entries are ignored; any other unknown key raises. Tied models get no
    `lm_head.weight`, as in HF's saved files.
    """
    states = [mcore_states] if isinstance(mcore_states, Mapping) else list(mcore_states)
    shape = _Shape.of(hf_config)
    names = [name for name in states[0] if not name.endswith("_extra_state")]
    for rank, state in enumerate(states[1:], start=1):
        other = [name for name in state if not name.endswith("_extra_state")]
        if sorted(other) != sorted(names):
            differing = sorted(set(other) ^ set(names))[:8]
            raise ValueError(f"tp rank {rank} and rank 0 differ in keys {differing}")
    full = {name: _merge_ranks(name, [state[name] for state in states]) for name in names}

    out: dict[str, Tensor] = {}
    missing: list[str] = []

    def take(name: str) -> Tensor:
        if name not in full:
            missing.append(name)
            return torch.empty(0)
        return full.pop(name)

    for hf_name, (mc_name, kind) in shape.global_names().items():
        tensor = take(mc_name)
        out[hf_name] = tensor[: shape.vocab_size] if kind == _VOCAB else tensor
    for layer in range(shape.num_layers):
        hf_prefix, mc_prefix = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        for hf_name, (mc_name, _) in shape.layer_names().items():
            out[hf_prefix + hf_name] = take(mc_prefix + mc_name)
        for param in shape.qkv_params():
            qkv = take(f"{mc_prefix}self_attention.linear_qkv.{param}")
            if qkv.numel():
                q, k, v = split_qkv(
                    qkv,
                    num_heads=shape.num_heads,
                    num_query_groups=shape.num_query_groups,
                    head_dim=shape.head_dim,
                )
                for proj, tensor in zip("qkv", (q, k, v), strict=True):
                    out[f"{hf_prefix}self_attn.{proj}_proj.{param}"] = tensor
        fc1 = take(f"{mc_prefix}mlp.linear_fc1.weight")
        if fc1.numel():
            gate, up = fc1.chunk(2, dim=0)
            out[f"{hf_prefix}mlp.gate_proj.weight"] = gate
            out[f"{hf_prefix}mlp.up_proj.weight"] = up
    if missing or full:
        raise ValueError(
            f"Megatron state does not match {SUPPORTED_MODEL_TYPES[shape.model_type]}: "
            f"missing {missing[:8]}, unmapped {sorted(full)[:8]}"
        )
    return out


def gather_tensor_parallel_states(state: Mapping[str, Tensor], *, on_device: bool = False) -> list[dict[str, Tensor]]:
    """All tensor-parallel ranks' state dicts (rank order), gathered on every rank: CPU tensors,
    or with `on_device` left on the model's device (with one rank: the model's own tensors, detached).

    Collective over the tensor-parallel group: every rank of the group must call it.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    names = [name for name in state if not name.endswith("_extra_state")]
    if tp_size == 1:
        return [{name: state[name].detach() if on_device else state[name].detach().cpu() for name in names}]
    group = parallel_state.get_tensor_model_parallel_group()
    gathered: list[dict[str, Tensor]] = [{} for _ in range(tp_size)]
    for name in names:
        local = state[name].detach().contiguous()
        shards = [torch.empty_like(local) for _ in range(tp_size)]
        dist.all_gather(shards, local, group=group)
        for rank, shard in enumerate(shards):
            gathered[rank][name] = shard if on_device else shard.cpu()
    return gathered


def _read_hf_folder(hf_dir: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {hf_dir}")
    state: dict[str, Tensor] = {}
    for file in files:
        state.update(load_file(file))
    return state


def load_hf_into_megatron(model: GPTModel, hf_dir: str | Path) -> Any:
    """Load an HF safetensors folder into a built GPTModel (this rank's shard).

    Returns the folder's HF config. The model must have been built from that config
    (`build_gpt_model`) under the current tensor-parallel layout.
    """
    from transformers import AutoConfig

    hf_dir = Path(hf_dir)
    hf_config = AutoConfig.from_pretrained(hf_dir)
    load_hf_state_into_megatron(model, _read_hf_folder(hf_dir), hf_config, source=str(hf_dir))
    return hf_config


def load_hf_state_into_megatron(
    model: GPTModel, hf_state: Mapping[str, Tensor], hf_config: Any, *, source: str = "HF weights"
) -> None:
    """Copy HF-named weights (a checkpoint's, read or kept in memory) into a built GPTModel: this
    rank's shard, cast to the model's dtype and device. `source` names them in errors."""
    from megatron.core import parallel_state

    state = hf_to_megatron(
        hf_state,
        hf_config,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
    )
    incompatible = model.load_state_dict(state, strict=False)
    missing = [name for name in incompatible.missing_keys if not name.endswith("_extra_state")]
    if missing or incompatible.unexpected_keys:
        raise ValueError(
            f"loading {source} into GPTModel: missing {missing[:8]}, unexpected {incompatible.unexpected_keys[:8]}"
        )
    logger.info("loaded %d HF tensors from %s", len(state), source)
