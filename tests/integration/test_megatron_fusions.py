"""The fused-kernel replacements equal the Megatron code they replace (CPU, eager; tests/gpu
repeats the model-level check compiled, in bf16)."""

from __future__ import annotations

import pytest
import torch

from tasks.megatron import fusions

VOCAB = 97


def rotary_freqs(positions: int, rot_dim: int, *, base: float = 10000.0) -> torch.Tensor:
    """Megatron's layout: [s, 1, 1, rot_dim], the half-frequencies repeated (not interleaved)."""
    inv = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot_dim", [16, 8])
def test_rope_bshd_equals_megatrons_unfused_rope(dtype, rot_dim):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    t = torch.randn(11, 3, 4, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    freqs = rotary_freqs(20, rot_dim)
    want = _apply_rotary_pos_emb_bshd(t, freqs[:11])
    got = fusions.rope_bshd(t, freqs)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_rope_bshd_gradient_equals_megatrons():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    t = torch.randn(7, 2, 4, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    upstream = torch.randn(7, 2, 4, 16, generator=torch.Generator().manual_seed(2))
    freqs = rotary_freqs(7, 16)
    (want,) = torch.autograd.grad(_apply_rotary_pos_emb_bshd(t, freqs), t, upstream)
    (got,) = torch.autograd.grad(fusions.rope_bshd(t, freqs), t, upstream)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def context_parallel_group():
    from megatron.core import parallel_state

    from tasks.megatron.parallel import init_parallel

    init_parallel(tensor_parallel=1, seed=0)
    return parallel_state.get_context_parallel_group()


@pytest.mark.parametrize("lengths", [[5, 3, 9, 1], [18]])
def test_rope_thd_equals_megatrons_per_sample_loop(context_parallel_group, lengths):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    total = sum(lengths)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    t = torch.randn(total, 4, 16, generator=torch.Generator().manual_seed(3))
    freqs = rotary_freqs(max(lengths), 16)  # what GPTModel passes: max_seqlen positions
    want = _apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_group=context_parallel_group)
    got = fusions.rope_thd(t, cu_seqlens, freqs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_rope_thd_refuses_positions_its_freqs_do_not_cover():
    cu_seqlens = torch.tensor([0, 4, 12], dtype=torch.int32)
    with pytest.raises(ValueError, match="cover 6 positions, a packed sample has 8"):
        fusions.rope_thd(torch.zeros(12, 2, 8), cu_seqlens, rotary_freqs(6, 8))
    with pytest.raises(ValueError, match=r"do not cover the 13 packed tokens"):
        fusions.rope_thd(torch.zeros(13, 2, 8), cu_seqlens, rotary_freqs(8, 8))


@pytest.fixture(scope="module")
def hf_config():
    from tests.synthetic import tiny_qwen3_config

    return tiny_qwen3_config(VOCAB)


def test_models_route_rope_through_the_installed_hooks_with_equal_logits(hf_config, monkeypatch):
    """With `apply_rope_fusion` on, Megatron's attention calls rope_bshd / rope_thd, and padded and
    packed forwards give the logits of the unfused path."""
    from megatron.core.models.common.embeddings import rope_utils

    from tasks.megatron.model import build_gpt_model
    from tasks.megatron.packing import pack_sequences
    from tasks.megatron.parallel import init_parallel

    init_parallel(tensor_parallel=1, seed=4)
    model = build_gpt_model(hf_config, parallel_output=False, attention="sdpa").eval()
    calls = {"bshd": 0, "thd": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", counted("bshd", fusions.rope_bshd))
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", counted("thd", fusions.rope_thd))
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (2, 10), generator=gen)
    positions = torch.arange(10).expand(2, 10)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    responses = [[10, 11], [12, 13, 14, 15], [16]]
    packed = pack_sequences(prompts, responses, pad_to_multiple=8)
    outputs = {}
    for fused in (False, True):
        monkeypatch.setattr(model.config, "apply_rope_fusion", fused)
        with torch.no_grad():
            outputs[fused] = (
                model(tokens, positions, None),
                model(packed.tokens, packed.position_ids, None, packed_seq_params=packed.packed_seq_params()),
            )
    layers = hf_config.num_hidden_layers
    assert calls == {"bshd": 2 * layers, "thd": 2 * layers}  # q and k in every layer
    for want, got in zip(outputs[False], outputs[True], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_fused_kernels_need_a_cuda_device(hf_config):
    from tasks.megatron.model import build_gpt_model
    from tasks.megatron.parallel import init_parallel

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    init_parallel(tensor_parallel=1, seed=0)
    with pytest.raises(ValueError, match=r"train\.fused_kernels\) needs a CUDA device"):
        build_gpt_model(hf_config, fused_kernels=True)


def test_foreach_l2_norm_equals_megatrons_local_fallback(monkeypatch):
    from megatron.core import utils

    import tasks.megatron.compat  # noqa: F401  (the local fallback writes its result to "cuda")

    tensors = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in (3, 70, 1, 512)]
    tasks.megatron.compat.apply_cpu_compat()
    want, _ = utils.local_multi_tensor_l2_norm(0, None, [tensors], False)
    got, _ = fusions.foreach_l2_norm(0, None, [tensors], False)
    assert got.shape == (1,) and got.dtype == torch.float32
    torch.testing.assert_close(got, want.to(got.device), rtol=1e-6, atol=0)
    with pytest.raises(NotImplementedError):
        fusions.foreach_l2_norm(0, None, [tensors], True)


def test_foreach_scale_equals_megatrons_local_fallback():
    from megatron.core import utils

    def fresh():
        gen = torch.Generator().manual_seed(7)
        return [torch.randn(n, generator=gen) for n in (5, 33)]

    for scale in (0.37, 1.0):
        # in place (gradient clipping) and fp32 -> bf16 copies (main params to model params)
        for dst_dtype in (None, torch.bfloat16):
            src_a, src_b = fresh(), fresh()
            if dst_dtype is None:
                dst_a, dst_b = src_a, src_b
            else:
                dst_a = [torch.zeros_like(t, dtype=dst_dtype) for t in src_a]
                dst_b = [torch.zeros_like(t, dtype=dst_dtype) for t in src_b]
            utils.local_multi_tensor_scale(0, None, [src_a, dst_a], scale)
            fusions.foreach_scale(0, None, [src_b, dst_b], scale)
            for want, got in zip(dst_a, dst_b, strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.fixture(scope="module")
def trainer_inputs(tmp_path_factory):
    from tests.synthetic import write_training_inputs

    hf, _, columns = write_training_inputs(tmp_path_factory.mktemp("fusions"))
    return hf, columns


def one_step(hf, columns, *, fused_adamw: bool, foreach_norm: bool, monkeypatch) -> tuple[dict, dict]:
    import megatron.core.optimizer.clip_grads as clip_grads

    from tasks.config import build_config
    from tasks.megatron.trainer import MegatronTrainer

    cfg = build_config(
        {
            "iterations": 1,
            "data": {"prompts_per_iteration": 4},
            "rollout": {"group_size": 4},
            "train": {"steps_per_iteration": 2, "micro_batch_size": 4},
            "optimizer": {"lr": 1e-2, "grad_clip": 0.05, "weight_decay": 0.1},
        }
    )
    trainer = MegatronTrainer(cfg, hf)
    if fused_adamw:
        assert fusions.use_fused_adamw(trainer.optimizer) >= 1
    with monkeypatch.context() as patch:
        if foreach_norm:
            patch.setattr(clip_grads, "l2_norm_impl", fusions.foreach_l2_norm)
        metrics = trainer.train_iteration(columns, iteration=1)
    weights = {k: v.detach().clone() for k, v in trainer.model.module.state_dict().items() if k.endswith("weight")}
    return metrics, weights


def test_fused_adamw_and_the_foreach_norm_give_the_same_clipped_steps(trainer_inputs, monkeypatch):
    hf, columns = trainer_inputs
    base, w_base = one_step(hf, columns, fused_adamw=False, foreach_norm=False, monkeypatch=monkeypatch)
    fast, w_fast = one_step(hf, columns, fused_adamw=True, foreach_norm=True, monkeypatch=monkeypatch)
    assert base["train/grad_norm"] > 0.05  # the clip is active
    assert fast["train/grad_norm"] == pytest.approx(base["train/grad_norm"], rel=1e-6)
    assert fast["train/loss"] == pytest.approx(base["train/loss"], rel=1e-6)
    for name in w_base:
        torch.testing.assert_close(w_fast[name], w_base[name], rtol=1e-5, atol=1e-6)


def test_use_fused_adamw_refuses_an_optimizer_that_has_stepped(trainer_inputs, monkeypatch):
    hf, columns = trainer_inputs
    from tasks.config import build_config
    from tasks.megatron.trainer import MegatronTrainer

    cfg = build_config({"iterations": 1, "data": {"prompts_per_iteration": 4}, "rollout": {"group_size": 4}})
    trainer = MegatronTrainer(cfg, hf)
    trainer.train_iteration(columns, iteration=1)
    with pytest.raises(RuntimeError, match="before the first optimizer step"):
        fusions.use_fused_adamw(trainer.optimizer)


def test_compiled_rms_norm_module_equals_megatrons_torch_norm():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        use_cpu_initialization=True,
    )
    torch_norm = WrappedTorchNorm(config=config, hidden_size=16, eps=1e-6)
    ours = fusions.CompiledRMSNorm(config=config, hidden_size=16, eps=1e-6)
    assert set(dict(ours.named_parameters())) == set(dict(torch_norm.named_parameters())) == {"weight"}
    weight = torch.randn(16, generator=torch.Generator().manual_seed(8))
    for norm in (torch_norm, ours):
        norm.weight.data.copy_(weight)
    x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(9), requires_grad=True)
    upstream = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(10))
    want = torch_norm(x)
    got = ours(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    grads_want = torch.autograd.grad(want, (x, torch_norm.weight), upstream)
    grads_got = torch.autograd.grad(got, (x, ours.weight), upstream)
    for g, w in zip(grads_got, grads_want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="config asks for 'LayerNorm'"):
        fusions.CompiledRMSNorm(
            config=TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True),
            hidden_size=16,
        )


def test_batch_first_logits_keep_the_logits_and_gradients_and_skip_the_copy(hf_config):
    from tasks.megatron.model import build_gpt_model
    from tasks.megatron.parallel import init_parallel

    init_parallel(tensor_parallel=1, seed=11)
    plain = build_gpt_model(hf_config, parallel_output=False)
    hooked = build_gpt_model(hf_config, parallel_output=False)
    hooked.load_state_dict(plain.state_dict())
    fusions.batch_first_logits(hooked)
    tokens = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(12))
    positions = torch.arange(9).expand(3, 9)
    results = []
    for model in (plain, hooked):
        logits = model(tokens, positions, None)
        assert logits.shape == (3, 9, VOCAB) and logits.is_contiguous()
        logits.float().logsumexp(-1).sum().backward()
        results.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-6)
    # what the output layer hands back is an [s, b, V] view of [b, s, V] memory, so Megatron's final
    # transpose is a view and its .contiguous() copies nothing
    seen = {}
    hooked.output_layer.register_forward_hook(lambda m, a, out: seen.update(shape=out[0].shape, stride=out[0].stride()))
    with torch.no_grad():
        hooked(tokens, positions, None)
    assert seen == {"shape": (9, 3, VOCAB), "stride": (VOCAB, 9 * VOCAB, 1)}


def test_wgrad_gemm_accum_adds_the_weight_gradient_into_main_grad():
    gen = torch.Generator().manual_seed(13)
    total_input = torch.randn(10, 4, generator=gen)
    grad_output = torch.randn(10, 6, generator=gen)
    main_grad = torch.randn(6, 4, generator=gen)
    want = main_grad + grad_output.t() @ total_input
    fusions.wgrad_gemm_accum(total_input, grad_output, main_grad)
    torch.testing.assert_close(main_grad, want, rtol=1e-6, atol=1e-6)
