"""HF <-> Megatron-core conversion and Megatron training on CPU, against tiny random HF models.

The oracle everywhere is the HF model itself: same weights, same tokens, same logits/gradients.
"""

from __future__ import annotations

import math
import threading
import warnings

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config, Qwen3Config

from tasks.megatron import compat
from tasks.megatron.convert import (
    hf_to_megatron,
    interleave_qkv,
    megatron_to_hf,
    padded_vocab_size,
    split_qkv,
)
from tasks.megatron.hf_export import save_megatron_as_hf
from tasks.megatron.model import build_gpt_model
from tasks.megatron.parallel import destroy_parallel, init_parallel

VOCAB = 128
CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
FAMILIES = [
    ("llama", True),
    ("llama", False),
    ("qwen2", False),
    ("qwen2", True),
    ("qwen3", False),
    ("qwen3", True),
]


def tiny_config(model_type: str, *, tied: bool, vocab_size: int = VOCAB):
    return CONFIGS[model_type](
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        initializer_range=0.1,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
    )


def tiny_hf_model(model_type: str, *, tied: bool, seed: int = 0) -> torch.nn.Module:
    """A random HF model whose norms and biases are random too, so a mis-mapped one shows."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, tied=tied)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.2 * torch.randn_like(param))
    return model


@pytest.fixture
def mcore():
    """Megatron at TP=1 in this process (reused across tests), reseeded for each test."""
    return init_parallel(tensor_parallel=1, seed=0)


def megatron_from_hf(hf_model: torch.nn.Module) -> torch.nn.Module:
    model = build_gpt_model(hf_model.config)
    model.load_state_dict(hf_to_megatron(hf_model.state_dict(), hf_model.config), strict=True)
    return model.eval()


def batch(seed: int = 1, *, rows: int = 2, length: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))
    return ids, torch.arange(length).expand(rows, length)


def max_logit_diff(hf_model: torch.nn.Module, model: torch.nn.Module) -> float:
    ids, positions = batch()
    with torch.no_grad():
        expected = hf_model(ids).logits  # [B, S, V]
        got = model(ids, positions, attention_mask=None)  # [B, S, V]
    assert got.shape == expected.shape
    return (got - expected).abs().max().item()


@pytest.mark.parametrize(("model_type", "tied"), FAMILIES)
def test_hf_to_megatron_logits_match_hf(mcore, model_type, tied):
    hf_model = tiny_hf_model(model_type, tied=tied)
    assert max_logit_diff(hf_model, megatron_from_hf(hf_model)) < 1e-5


def test_llama3_rope_scaling_matches_hf(mcore):
    config = tiny_config("llama", tied=True)
    config.rope_parameters = {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config).eval()
    assert max_logit_diff(hf_model, megatron_from_hf(hf_model)) < 1e-5
    config.rope_parameters["high_freq_factor"] = 2.0
    with pytest.raises(NotImplementedError, match="high_freq_factor"):
        build_gpt_model(config)


@pytest.mark.parametrize(("model_type", "tied"), FAMILIES)
def test_megatron_to_hf_round_trip_is_exact(mcore, model_type, tied):
    hf_model = tiny_hf_model(model_type, tied=tied)
    back = megatron_to_hf(megatron_from_hf(hf_model).state_dict(), hf_model.config)
    expected = {k: v for k, v in hf_model.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert sorted(back) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize(
    "param",
    ["self_attention.linear_qkv.weight", "mlp.linear_fc1.weight", "pre_mlp_layernorm.weight"],
)
def test_perturbing_one_weight_breaks_the_match(mcore, param):
    hf_model = tiny_hf_model("qwen3", tied=False)
    model = megatron_from_hf(hf_model)
    with torch.no_grad():
        model.state_dict()[f"decoder.layers.1.{param}"].view(-1)[3] += 0.5
    assert max_logit_diff(hf_model, model) > 1e-3


def test_attention_is_causal_without_a_mask(mcore):
    model = megatron_from_hf(tiny_hf_model("qwen2", tied=False))
    ids, positions = batch()
    changed = ids.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % VOCAB
    with torch.no_grad():
        a = model(ids, positions, attention_mask=None)
        b = model(changed, positions, attention_mask=None)
    assert torch.equal(a[:, :7], b[:, :7])
    assert (a[:, 7:] - b[:, 7:]).abs().max() > 1e-3


def test_tensor_parallel_shards_hold_whole_query_groups():
    """TP=2 with 2 KV groups: rank r holds exactly group r's q heads, k head and v head."""
    config = tiny_config("qwen2", tied=False)
    state = tiny_hf_model("qwen2", tied=False).state_dict()
    prefix = "model.layers.0.self_attn."
    q_per_rank, kv_per_rank = 2 * 16, 16
    for rank in range(2):
        shard = hf_to_megatron(state, config, tp_rank=rank, tp_size=2)
        for param in ("weight", "bias"):
            q, k, v = (state[f"{prefix}{p}_proj.{param}"] for p in "qkv")
            expected = torch.cat(
                [
                    q[rank * q_per_rank : (rank + 1) * q_per_rank],
                    k[rank * kv_per_rank : (rank + 1) * kv_per_rank],
                    v[rank * kv_per_rank : (rank + 1) * kv_per_rank],
                ]
            )
            got = shard[f"decoder.layers.0.self_attention.linear_qkv.{param}"]
            assert torch.equal(got, expected)
        gate = state["model.layers.0.mlp.gate_proj.weight"]
        up = state["model.layers.0.mlp.up_proj.weight"]
        fc1 = shard["decoder.layers.0.mlp.linear_fc1.weight"]
        assert torch.equal(fc1, torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]]))
        o_proj = state["model.layers.0.self_attn.o_proj.weight"]
        linear_proj = shard["decoder.layers.0.self_attention.linear_proj.weight"]
        assert torch.equal(linear_proj, o_proj.chunk(2, dim=1)[rank])


@pytest.mark.parametrize("tied", [True, False])
def test_tensor_parallel_shards_merge_back_with_vocab_padding(tied):
    config = tiny_config("llama", tied=tied, vocab_size=127)
    torch.manual_seed(0)
    state = AutoModelForCausalLM.from_config(config).state_dict()
    shards = [hf_to_megatron(state, config, tp_rank=rank, tp_size=2) for rank in range(2)]
    assert padded_vocab_size(127, tensor_parallel=2) == 128
    embedding = [shard["embedding.word_embeddings.weight"] for shard in shards]
    assert [tuple(e.shape) for e in embedding] == [(64, 64), (64, 64)]
    assert torch.equal(embedding[1][-1], torch.zeros(64))  # the padded row
    back = megatron_to_hf(shards, config)
    expected = {k: v for k, v in state.items() if not (tied and k == "lm_head.weight")}
    assert sorted(back) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(back[name], tensor), name


def test_qkv_interleave_and_split_are_inverse():
    q, k, v = torch.randn(8 * 4, 5), torch.randn(2 * 4, 5), torch.randn(2 * 4, 5)
    qkv = interleave_qkv(q, k, v, num_query_groups=2, head_dim=4)
    assert torch.equal(qkv[:24], torch.cat([q[:16], k[:4], v[:4]]))  # group 0: 4 q heads, k, v
    for got, want in zip(split_qkv(qkv, num_heads=8, num_query_groups=2, head_dim=4), (q, k, v), strict=True):
        assert torch.equal(got, want)


def test_unsupported_architectures_raise_naming_them(mcore):
    gpt2 = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB)
    gpt2.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(NotImplementedError, match="GPT2LMHeadModel"):
        build_gpt_model(gpt2)
    with pytest.raises(NotImplementedError, match="GPT2LMHeadModel"):
        hf_to_megatron({}, gpt2)
    biased = tiny_config("llama", tied=False)
    biased.attention_bias = True
    with pytest.raises(NotImplementedError, match="attention_bias"):
        build_gpt_model(biased)


def test_unmapped_hf_weights_raise():
    hf_model = tiny_hf_model("llama", tied=False)
    state = dict(hf_model.state_dict())
    state["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    with pytest.raises(ValueError, match="o_proj.bias"):
        hf_to_megatron(state, hf_model.config)
    del state["model.layers.0.self_attn.o_proj.bias"], state["model.norm.weight"]
    with pytest.raises(ValueError, match="model.norm.weight"):
        hf_to_megatron(state, hf_model.config)


@pytest.mark.parametrize(("model_type", "tied"), [("qwen3", False), ("llama", True)])
def test_save_megatron_as_hf_reloads_with_auto_model(mcore, tmp_path, model_type, tied):
    hf_model = tiny_hf_model(model_type, tied=tied)
    written = save_megatron_as_hf(megatron_from_hf(hf_model), hf_model.config, tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    # what it returns is what it wrote, in copies of their own
    stored = load_file(tmp_path / "hf" / "model.safetensors")
    assert written.keys() == stored.keys()
    assert all(torch.equal(written[k], stored[k]) for k in stored)
    pointers = [t.untyped_storage().data_ptr() for t in written.values()]
    assert len(set(pointers)) == len(pointers)
    assert reloaded.config.architectures == [type(hf_model).__name__]
    ids, _ = batch()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf_model(ids).logits)


def test_gradients_match_hf_and_adamw_steps(mcore):
    """Backward through Megatron gives HF's gradients; a torch AdamW loop lowers the loss."""
    hf_model = tiny_hf_model("qwen3", tied=False)
    model = megatron_from_hf(hf_model)
    ids, positions = batch(rows=2, length=13)
    inputs, labels = ids[:, :-1], ids[:, 1:]

    hf_logits = hf_model(inputs).logits
    torch.nn.functional.cross_entropy(hf_logits.reshape(-1, VOCAB), labels.reshape(-1)).backward()
    logits = model(inputs, positions[:, :-1], attention_mask=None)
    torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)).backward()

    grads = megatron_to_hf({n: p.grad for n, p in model.named_parameters()}, hf_model.config)
    for name, param in hf_model.named_parameters():
        assert (grads[name] - param.grad).abs().max() < 1e-5, name

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = model(inputs, positions[:, :-1], None, labels=labels).mean()  # [B, S] -> []
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[2] < losses[0]


def test_megatron_ddp_and_optimizer_clip_grads_on_cpu(mcore):
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    hf_model = tiny_hf_model("llama", tied=True)
    model = megatron_from_hf(hf_model).train()
    ids, positions = batch(rows=2, length=13)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    hf_loss = torch.nn.functional.cross_entropy(hf_model(inputs).logits.reshape(-1, VOCAB), labels.reshape(-1))
    hf_loss.backward()
    hf_norm = math.sqrt(sum(p.grad.pow(2).sum().item() for p in hf_model.parameters()))
    assert hf_norm > 1.0  # so that clip_grad=1.0 really clips

    ddp = DistributedDataParallel(
        config=model.config,
        ddp_config=DistributedDataParallelConfig(overlap_grad_reduce=False),
        module=model,
    )
    config = OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0)
    optimizer = get_megatron_optimizer(config, [ddp])
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    ddp(inputs, positions[:, :-1], None, labels=labels).mean().backward()
    finalize_model_grads([ddp])
    ok, grad_norm, _ = optimizer.step()

    assert ok and math.isfinite(grad_norm)
    assert grad_norm == pytest.approx(hf_norm, rel=1e-5)
    clipped = [p.grad for p in optimizer.get_parameters() if p.grad is not None]
    assert math.sqrt(sum(g.pow(2).sum().item() for g in clipped)) == pytest.approx(1.0, rel=1e-4)


def test_dist_checkpoint_round_trip_at_tp1(mcore, tmp_path):
    from megatron.core import dist_checkpointing

    hf_model = tiny_hf_model("qwen2", tied=False)
    saved = megatron_from_hf(hf_model)
    dist_checkpointing.save(saved.sharded_state_dict(), str(tmp_path))
    fresh = build_gpt_model(hf_model.config)  # random init, different weights
    assert not torch.equal(fresh.output_layer.weight, saved.output_layer.weight)
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), str(tmp_path)))
    for (name, a), (_, b) in zip(saved.state_dict().items(), fresh.state_dict().items(), strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name


def test_init_parallel_reuses_rebuilds_and_restarts():
    from megatron.core import parallel_state

    layout = init_parallel(tensor_parallel=1, seed=3)
    group = parallel_state.get_tensor_model_parallel_group()
    assert (layout.world_size, layout.tensor_parallel, layout.data_parallel) == (1, 1, 1)
    first = torch.rand(3)
    init_parallel(tensor_parallel=1, seed=3)
    assert parallel_state.get_tensor_model_parallel_group() is group  # reused
    assert torch.equal(torch.rand(3), first)  # reseeded
    with pytest.raises(ValueError, match="tensor_parallel=2"):
        init_parallel(tensor_parallel=2, seed=3)
    destroy_parallel()
    destroy_parallel()  # idempotent
    assert not parallel_state.model_parallel_is_initialized()
    assert init_parallel(tensor_parallel=1, seed=3) == layout


def test_cpu_compat_is_per_thread(mcore):
    """The device rewrite is a per-thread torch mode: a new thread needs apply_cpu_compat()."""
    model = megatron_from_hf(tiny_hf_model("qwen3", tied=False))
    ids, positions = batch()
    outcome: dict[str, object] = {}

    def forward(apply: bool) -> None:
        if apply:
            compat.apply_cpu_compat()
        try:
            with torch.no_grad():
                outcome[str(apply)] = model(ids, positions, attention_mask=None)
        except (RuntimeError, AssertionError) as error:  # CUDA calls on a CPU-only torch
            outcome[str(apply)] = error

    for apply in (False, True):
        thread = threading.Thread(target=forward, args=(apply,))
        thread.start()
        thread.join()
    assert isinstance(outcome["False"], (RuntimeError, AssertionError))
    with torch.no_grad():
        assert torch.equal(outcome["True"], model(ids, positions, attention_mask=None))


def test_unknown_megatron_version_warns(monkeypatch):
    monkeypatch.setattr(compat, "_megatron_version", lambda: "0.0.7")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compat._check_version()
    assert any("0.0.7" in str(w.message) for w in caught)


def test_without_device_rewrite_suspends_the_mode_for_the_block_only(mcore):
    """Inside the block a CUDA device is not rewritten (a CPU-only torch refuses it); after it,
    the thread's rewrite is back; another mode on top of it is refused, not popped."""
    from torch.overrides import TorchFunctionMode, _get_current_function_mode

    assert torch.zeros(1, device="cuda").device.type == "cpu"
    rewrite = _get_current_function_mode()
    with compat.without_device_rewrite():
        assert _get_current_function_mode() is None
        with pytest.raises((RuntimeError, AssertionError)):
            torch.zeros(1, device="cuda")
    assert _get_current_function_mode() is rewrite
    assert torch.zeros(1, device="cuda").device.type == "cpu"

    with TorchFunctionMode(), pytest.raises(RuntimeError, match="not the innermost"):
        with compat.without_device_rewrite():
            pass
    assert _get_current_function_mode() is rewrite
