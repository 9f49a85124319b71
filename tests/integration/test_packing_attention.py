"""The SDPA core attention equals Megatron's default one, and a packed forward equals per-sample forwards."""

from __future__ import annotations

import pytest
import torch

from tasks.megatron.packing import pack_sequences, plan_packs

VOCAB = 97


@pytest.fixture(scope="module")
def hf_config():
    from tests.synthetic import tiny_qwen3_config

    return tiny_qwen3_config(VOCAB)


@pytest.fixture(scope="module")
def models(hf_config):
    from tasks.megatron.model import build_gpt_model
    from tasks.megatron.parallel import init_parallel

    init_parallel(tensor_parallel=1, seed=3)
    local = build_gpt_model(hf_config, parallel_output=False).eval()
    sdpa = build_gpt_model(hf_config, parallel_output=False, attention="sdpa").eval()
    sdpa.load_state_dict(local.state_dict())
    return local, sdpa


def random_samples(seed: int, count: int) -> tuple[list[list[int]], list[list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(0, VOCAB, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(count)
    ]
    responses = [
        torch.randint(0, VOCAB, (int(torch.randint(0, 7, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(count)
    ]
    return prompts, responses


def test_sdpa_core_attention_equals_the_default_attention_on_a_padded_batch(models):
    from tasks.megatron.attention import SDPACoreAttention

    local, sdpa = models
    assert isinstance(sdpa.decoder.layers[0].self_attention.core_attention, SDPACoreAttention)
    tokens = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(11).expand(3, 11)
    with torch.no_grad():
        want = local(tokens, positions, None)
        got = sdpa(tokens, positions, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sdpa_gradients_equal_the_default_attention(models):
    local, sdpa = models
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(9).expand(2, 9)
    grads = []
    for model in (local, sdpa):
        model.zero_grad()
        model(tokens, positions, None).float().logsumexp(-1).sum().backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-5)


def test_a_packed_forward_equals_each_sample_forward_alone(models):
    _, sdpa = models
    prompts, responses = random_samples(2, 5)
    packed = pack_sequences(prompts, responses, pad_to_multiple=8)
    assert packed.num_tokens % 8 == 0
    with torch.no_grad():
        logits = sdpa(packed.tokens, packed.position_ids, None, packed_seq_params=packed.packed_seq_params())[0]
        for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            seq = torch.tensor([p + r])
            alone = sdpa(seq, torch.arange(seq.shape[1])[None], None)[0]  # [n, V]
            rows = (packed.sample_ids == b).nonzero()[:, 0]
            torch.testing.assert_close(logits[rows], alone, rtol=1e-5, atol=1e-5)


def test_a_packed_forward_differs_when_samples_are_reordered_only_by_position(models):
    """Attention does not cross samples: swapping two samples permutes the logits, nothing else."""
    _, sdpa = models
    prompts, responses = random_samples(4, 2)
    with torch.no_grad():
        ab = pack_sequences(prompts, responses)
        ba = pack_sequences(prompts[::-1], responses[::-1])
        out_ab = sdpa(ab.tokens, ab.position_ids, None, packed_seq_params=ab.packed_seq_params())[0]
        out_ba = sdpa(ba.tokens, ba.position_ids, None, packed_seq_params=ba.packed_seq_params())[0]
    for b in range(2):
        torch.testing.assert_close(out_ab[ab.sample_ids == b], out_ba[ba.sample_ids == 1 - b], rtol=1e-5, atol=1e-5)


def test_index_maps_point_at_the_logits_that_predict_each_response_token():
    prompts = [[5, 6, 7], [8], [9, 10]]
    responses = [[1, 2], [3, 4, 11], []]
    packed = pack_sequences(prompts, responses, pad_to_multiple=4)
    tokens = packed.tokens[0]
    assert tokens.tolist() == [5, 6, 7, 1, 2, 8, 3, 4, 11, 9, 10, 0]
    assert packed.cu_seqlens.tolist() == [0, 5, 9, 11, 12]
    assert packed.sample_ids.tolist() == [0] * 5 + [1] * 4 + [2] * 2 + [-1]
    assert packed.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 0]
    # the logits at row r predict tokens[r + 1]
    expected = [t for r in responses for t in r]
    assert tokens[packed.response_rows + 1].tolist() == expected
    assert packed.response_sample.tolist() == [0, 0, 1, 1, 1]
    assert packed.response_index.tolist() == [0, 1, 0, 1, 2]
    assert packed.logit_rows.tolist() == [[2, 3, 0], [5, 6, 7], [0, 0, 0]]


def test_plan_packs_respects_the_capacity_and_keeps_every_sample_once():
    lengths = [7, 3, 9, 2, 2, 5, 12, 1, 4]
    packs = plan_packs(lengths, capacity=10)
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
    for pack in packs:
        assert sum(lengths[i] for i in pack) <= 10 or len(pack) == 1
    # first-fit decreasing: the oversize 12 alone, then [9, 1], [7, 3], [5, 4], [2, 2]
    assert [[lengths[i] for i in p] for p in packs] == [[12], [9, 1], [7, 3], [5, 4], [2, 2]]


def test_recompute_gives_the_same_gradients(hf_config):
    from tasks.megatron.model import build_gpt_model
    from tasks.megatron.parallel import init_parallel

    init_parallel(tensor_parallel=1, seed=5)
    plain = build_gpt_model(hf_config, parallel_output=False, attention="sdpa")
    again = build_gpt_model(hf_config, parallel_output=False, attention="sdpa", recompute=True)
    again.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(6))
    positions = torch.arange(8).expand(2, 8)
    grads = []
    for model in (plain, again):
        model.train()
        model(tokens, positions, None).float().logsumexp(-1).sum().backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# the trainer with the GPU-path switches (run on the CPU here; tests/gpu repeats it in bf16)

GPU_PATH = {"attention": "sdpa", "packing": True, "pack_tokens": 24, "loss_chunk_tokens": 5, "recompute": True}


@pytest.fixture(scope="module")
def trainer_setup(tmp_path_factory):
    from tests.synthetic import write_training_inputs

    root = tmp_path_factory.mktemp("gpu_path")
    hf, path, columns = write_training_inputs(root)
    return root, hf, path, columns


def train_in_process(hf, columns, train: dict) -> tuple[dict, dict]:
    from tasks.config import build_config
    from tasks.megatron.trainer import MegatronTrainer

    cfg = build_config(
        {
            "iterations": 1,
            "data": {"prompts_per_iteration": 4},
            "rollout": {"group_size": 4},
            "train": {"steps_per_iteration": 1, "micro_batch_size": 3, **train},
            "optimizer": {"lr": 1e-2},
            "loss": {"type": "blend", "blend_lambda": 0.3, "mask_reduction": "exclude"},
        }
    )
    trainer = MegatronTrainer(cfg, hf)
    metrics = trainer.train_iteration(columns, iteration=1)
    return metrics, {
        k: v.detach().clone()
        for k, v in trainer.model.module.state_dict().items()
        if v is not None and k.endswith("weight")
    }


def test_packed_sdpa_chunked_recomputed_step_equals_the_default_step(trainer_setup):
    _, hf, _, columns = trainer_setup
    base, w_base = train_in_process(hf, columns, {})
    fast, w_fast = train_in_process(hf, columns, GPU_PATH)
    assert fast["train/loss"] == pytest.approx(base["train/loss"], rel=1e-5)
    assert fast["train/grad_norm"] == pytest.approx(base["train/grad_norm"], rel=1e-4)
    for name in w_base:
        torch.testing.assert_close(w_fast[name], w_base[name], rtol=1e-4, atol=2e-4)


def test_tensor_parallel_vocab_parallel_chunked_loss_equals_one_process(trainer_setup):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    root, hf, columns_path, columns = trainer_setup
    repo = Path(__file__).resolve().parents[2]
    out = root / "tp2"
    out.mkdir()
    overrides = {"train": {**GPU_PATH, "tensor_parallel": 2}}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(repo / "tests/integration/_scripts/train_variant_worker.py"),
        str(hf),
        str(columns_path),
        str(out),
        json.dumps(overrides),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo))
    done = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    tp2 = json.loads((out / "metrics.json").read_text())
    base, _ = train_in_process(hf, columns, {})
    assert tp2["train/loss"] == pytest.approx(base["train/loss"], rel=1e-5)
    assert tp2["train/grad_norm"] == pytest.approx(base["train/grad_norm"], rel=1e-4)
    assert load_file(str(out / "hf" / "model.safetensors"))  # the sharded model saves as one HF model


def test_logged_loss_metrics_do_not_depend_on_the_micro_batch_size(trainer_setup):
    """sdpo/* and grpo/* are means over the whole step's tokens (or samples), and the losses the
    step's sums: one sample per micro-batch logs what one micro-batch of all samples logs."""
    _, hf, _, columns = trainer_setup
    assert 0 < sum(columns["sample_mask"]) < len(columns["sample_mask"])  # some micro-batches have no active token
    one, _ = train_in_process(hf, columns, {"micro_batch_size": 1})
    whole, _ = train_in_process(hf, columns, {"micro_batch_size": len(columns["sample_id"])})
    logged = [name for name in whole if name.startswith(("sdpo/", "grpo/", "loss/"))]
    assert "sdpo/divergence_mean" in logged and "grpo/clip_fraction" in logged
    for name in logged:
        assert one[name] == pytest.approx(whole[name], rel=1e-5, abs=1e-7), name
    assert not any(name.startswith("count/") for name in whole)


def test_packed_cpu_attention_equals_per_sample_attention_with_gradients(models):
    """The CPU path attends a packed row's samples as one padded batch (`_padded_batch`); the oracle
    is one causal SDPA call per sample. Lengths differ widely, one segment is empty."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from torch.nn import functional as F

    _, sdpa = models
    core = sdpa.decoder.layers[0].self_attention.core_attention
    config = sdpa.config
    h, g, d = config.num_attention_heads, config.num_query_groups, config.kv_channels
    bounds = [0, 1, 7, 7, 30, 32]
    t = bounds[-1]
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(t, n, d, generator=gen, dtype=torch.float64, requires_grad=True) for n in (h, g, g))
    cu = torch.tensor(bounds, dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=23, max_seqlen_kv=23)
    out = core(q, k, v, None, packed_seq_params=params)  # [t, h*d]
    upstream = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), upstream)

    parts = []
    for a, z in zip(bounds[:-1], bounds[1:], strict=True):
        if z > a:
            qs, ks, vs = (x[a:z].transpose(0, 1) for x in (q, k, v))  # [h|g, n, d]
            alone = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=core.scale, enable_gqa=True)
            parts.append(alone.transpose(0, 1).reshape(z - a, h * d))
    expected = torch.cat(parts)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    for got, want in zip(grads, torch.autograd.grad(expected, (q, k, v), upstream), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
