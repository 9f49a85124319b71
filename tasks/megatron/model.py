"""Megatron-core GPT models built from Hugging Face configs (Llama, Qwen2, Qwen3).

The HF config is the single description of a model in this project: engines load the HF
folder, and the trainer builds the matching Megatron `GPTModel` (local spec, no Transformer
Engine) from the same config, then loads the weights through `tasks.megatron.convert`.

Notes on the built model:
- Forward: `model(input_ids, position_ids, attention_mask=None)` returns logits [B, S, V_pad/tp]
  (vocab-sharded under tensor parallelism unless `parallel_output=False`). With
  `attention_mask=None` the local spec's causal `DotProductAttention` builds the causal mask.
- `attention="sdpa"` puts `tasks.megatron.attention.SDPACoreAttention` (torch SDPA: cuDNN/flash
  on a GPU) in the layer spec instead; it also takes packed rows
  (`packed_seq_params=packing.PackedMicroBatch.packed_seq_params()`, tokens [1, L]), which the
  default attention cannot.
- `recompute=True` recomputes every layer in the backward pass (Megatron's full, uniform,
  one-layer recompute): activation memory for compute.
- Rotary embeddings use positions 0..S-1 of each row; `position_ids` do not reach RoPE. Batches
  must therefore be right-padded (the HF model with positions 0..S-1 gives the same logits).
- The vocabulary is padded to a multiple of the tensor-parallel size only
  (`padded_vocab_size`); slice logits to `hf_config.vocab_size` before a softmax.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from tasks.megatron.convert import (
    SUPPORTED_MODEL_TYPES,
    check_supported_config,
    head_dim_of,
    padded_vocab_size,
)

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

logger = logging.getLogger(__name__)

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "transformer_config_from_hf",
    "rope_settings_from_hf",
    "build_gpt_model",
]


def rope_settings_from_hf(hf_config: Any) -> dict[str, Any]:
    """GPTModel rotary keyword arguments for the config's `rope_parameters`.

    Supports plain RoPE and Llama-3 scaling with Megatron's fixed constants (low/high frequency
    factors 1 and 4, original context 8192); anything else raises with the offending values.
    """
    rope = dict(hf_config.rope_parameters)
    rope_type = rope["rope_type"]
    settings = {"rotary_base": float(rope["rope_theta"]), "rope_scaling": False}
    if rope_type == "default":
        return settings
    if rope_type == "llama3":
        fixed = {
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        got = {key: rope[key] for key in fixed}
        if got != fixed:
            raise NotImplementedError(f"llama3 rope scaling with {got}: Megatron's RotaryEmbedding hard-codes {fixed}")
        return {**settings, "rope_scaling": True, "rope_scaling_factor": float(rope["factor"])}
    raise NotImplementedError(f"rope_type={rope_type!r} ({rope}) is not mapped to Megatron")


def transformer_config_from_hf(
    hf_config: Any,
    *,
    params_dtype: torch.dtype = torch.float32,
    tensor_parallel: int = 1,
    recompute: bool = False,
    fused_kernels: bool = False,
) -> TransformerConfig:
    """The Megatron `TransformerConfig` equivalent of a Llama/Qwen2/Qwen3 HF config.

    Dropout is 0 (RL post-training, and the CPU RNG caveat in compat). Fusions that need
    Transformer Engine or Apex are off; `fused_kernels=True` turns on Megatron's compiled SwiGLU
    and residual add, the RoPE fusion and the weight-gradient accumulation fusion, whose kernels
    `tasks.megatron.fusions` provides (call `enable_fused_kernels()` first). The random init
    always runs, even when weights are loaded next: with `perform_initialization=False`
    megatron-core (0.16.1) never marks the parallel linear weights as tensor-parallel, and the
    optimizer's grad norm under TP>1 then counts only rank 0's shards.
    """
    from megatron.core.transformer import TransformerConfig

    model_type = check_supported_config(hf_config)
    if params_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"params_dtype={params_dtype}; use float32, bfloat16 or float16")
    n_heads = hf_config.num_attention_heads
    n_kv = hf_config.num_key_value_heads
    for name, count in (("num_attention_heads", n_heads), ("num_key_value_heads", n_kv)):
        if count % tensor_parallel:
            raise ValueError(f"{name}={count} is not divisible by tensor_parallel={tensor_parallel}")
    recompute_settings = (
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1} if recompute else {}
    )
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=n_heads,
        num_query_groups=n_kv,
        kv_channels=head_dim_of(hf_config),
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=model_type == "qwen2",
        qk_layernorm=model_type == "qwen3",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=hf_config.initializer_range,
        tensor_model_parallel_size=tensor_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=True,
        gradient_accumulation_fusion=fused_kernels,
        masked_softmax_fusion=False,
        bias_activation_fusion=fused_kernels,
        bias_dropout_fusion=fused_kernels,
        persist_layer_norm=False,
        apply_rope_fusion=fused_kernels,
        **recompute_settings,
    )


def build_gpt_model(
    hf_config: Any,
    *,
    params_dtype: torch.dtype = torch.float32,
    parallel_output: bool = True,
    attention: str = "local",
    recompute: bool = False,
    fused_kernels: bool = False,
) -> GPTModel:
    """A Megatron `GPTModel` (local spec) with the architecture of `hf_config`.

    Needs model parallelism initialised (`tasks.megatron.parallel.init_parallel`); the tensor-
    parallel size is read from it. Pipeline parallelism is not supported (one stage). The model
    is cast to `params_dtype` as a whole, because the local spec builds its RMSNorms in fp32 (and
    on the CPU: with CUDA the whole model is moved to the current device). `fused_kernels=True`
    installs `tasks.megatron.fusions` and builds the model with the fusions on (see
    `transformer_config_from_hf`).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("model parallelism is not initialised; call init_parallel() first")
    pipeline_parallel = parallel_state.get_pipeline_model_parallel_world_size()
    if pipeline_parallel != 1:
        raise NotImplementedError(f"pipeline_parallel={pipeline_parallel}; only 1 is supported")
    tensor_parallel = parallel_state.get_tensor_model_parallel_world_size()
    if fused_kernels:
        if not torch.cuda.is_available():
            raise ValueError("fused_kernels=True (train.fused_kernels) needs a CUDA device; set it to false on a CPU")
        from tasks.megatron.fusions import enable_fused_kernels

        enable_fused_kernels()
    config = transformer_config_from_hf(
        hf_config,
        params_dtype=params_dtype,
        tensor_parallel=tensor_parallel,
        recompute=recompute,
        fused_kernels=fused_kernels,
    )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm)
    block_spec: Any = spec
    if fused_kernels:
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

        from tasks.megatron.fusions import CompiledRMSNorm

        spec.submodules.input_layernorm = CompiledRMSNorm
        spec.submodules.pre_mlp_layernorm = CompiledRMSNorm
        if config.qk_layernorm:
            spec.submodules.self_attention.submodules.q_layernorm = CompiledRMSNorm
            spec.submodules.self_attention.submodules.k_layernorm = CompiledRMSNorm
        block_spec = TransformerBlockSubmodules(layer_specs=[spec] * config.num_layers, layer_norm=CompiledRMSNorm)
    if attention == "sdpa":
        from tasks.megatron.attention import SDPACoreAttention

        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    elif attention != "local":
        raise ValueError(f"attention={attention!r}; expected 'local' or 'sdpa'")
    model = GPTModel(
        config,
        block_spec,
        vocab_size=padded_vocab_size(hf_config.vocab_size, tensor_parallel=tensor_parallel),
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=True,
        post_process=True,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        position_embedding_type="rope",
        **rope_settings_from_hf(hf_config),
    )
    if torch.cuda.is_available():
        # Megatron's parallel layers are created on the GPU, but the local spec's torch norms
        # (WrappedTorchNorm) on the CPU: move the whole model to this rank's device.
        model.cuda(torch.cuda.current_device())
    model.to(dtype=params_dtype)
    if fused_kernels:
        from tasks.megatron.fusions import batch_first_logits

        batch_first_logits(model)
    logger.info(
        "built GPTModel for %s: %d layers, hidden %d, tp=%d, dtype=%s, attention=%s, recompute=%s, fused=%s",
        hf_config.model_type,
        config.num_layers,
        config.hidden_size,
        tensor_parallel,
        params_dtype,
        attention,
        recompute,
        fused_kernels,
    )
    return model
