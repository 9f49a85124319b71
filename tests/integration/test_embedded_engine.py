import numpy as np
import pytest
import torch

from tasks.data.bootstrap_model import build_model, build_tokenizer, prompt_ids
from tasks.engines.base import Generation, RolloutEngine
from tasks.engines.embedded import EmbeddedEngine

MESSAGES = [
    [{"role": "user", "content": "3+4="}],
    [{"role": "user", "content": "12+345="}],
    [{"role": "system", "content": "Add."}, {"role": "user", "content": "7+8="}],
]


def make_checkpoint(path, *, seed, sharpness):
    tokenizer = build_tokenizer(path)
    model = build_model(
        tokenizer, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, max_positions=64, seed=seed
    )
    with torch.no_grad():
        # a random model is nearly uniform; scaling the head gives peaked, tie-free distributions
        model.lm_head.weight.mul_(sharpness)
    model.save_pretrained(path)
    return tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    tokenizer = make_checkpoint(path, seed=0, sharpness=40.0)
    return path, tokenizer


@pytest.fixture(scope="module", params=["eager", "static"])
def engine(checkpoint, request):
    """Both decode loops: the eager one (the CPU's) and the static one a GPU captures, run eagerly."""
    path, _ = checkpoint
    engine = EmbeddedEngine(str(path), max_batch_size=4, decode=request.param)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompts(checkpoint):
    _, tokenizer = checkpoint
    ids = [prompt_ids(tokenizer, m) for m in MESSAGES]
    assert len({len(p) for p in ids}) == 3  # distinct lengths exercise the left padding
    return ids


def sample(engine, prompts, **overrides):
    kwargs = dict(n=3, temperature=1.0, top_p=1.0, max_new_tokens=6, stop_token_ids=[], top_k_logprobs=5, seed=0)
    kwargs.update(overrides)
    return engine.generate(prompts, **kwargs)


def sample_with_widths(engine, prompts, **overrides):
    """`sample`, and the batch size of each forward the model saw."""
    widths: list[int] = []
    handle = engine.model.register_forward_pre_hook(
        lambda _m, args, kw: widths.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        return sample(engine, prompts, **overrides), widths
    finally:
        handle.remove()


def assert_same_samples(a, b):
    """The same tokens and finish reasons; log-probs within 1e-5, the same top-K ids."""
    for group_a, group_b in zip(a, b, strict=True):
        assert [g.response_ids for g in group_a] == [g.response_ids for g in group_b]
        assert [g.finish_reason for g in group_a] == [g.finish_reason for g in group_b]
        for x, y in zip(group_a, group_b, strict=True):
            np.testing.assert_allclose(x.sampled_logprobs, y.sampled_logprobs, atol=1e-5)
            np.testing.assert_allclose(x.topk_logprobs, y.topk_logprobs, atol=1e-5)
            np.testing.assert_array_equal(x.topk_ids, y.topk_ids)


def full_logprobs(engine, prompt, response):
    """log_softmax of a plain unpadded forward at the positions predicting each response token: [T, V]."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(response)], dim=-1)


def test_engine_satisfies_the_interface(engine):
    assert isinstance(engine, RolloutEngine)


def test_shapes_and_dtypes(engine, prompts):
    out = sample(engine, prompts)
    assert len(out) == len(prompts) and all(len(group) == 3 for group in out)
    for group in out:
        for gen in group:
            assert isinstance(gen, Generation)
            num_tokens = len(gen.response_ids)
            assert num_tokens == 6 and gen.finish_reason == "length"
            assert gen.sampled_logprobs.shape == (num_tokens,) and gen.sampled_logprobs.dtype == np.float32
            assert gen.topk_ids.shape == (num_tokens, 5) and gen.topk_ids.dtype == np.int32
            assert gen.topk_logprobs.shape == (num_tokens, 5) and gen.topk_logprobs.dtype == np.float32
            assert np.all(np.diff(gen.topk_logprobs, axis=1) <= 0)  # most likely first
            assert np.all(gen.sampled_logprobs <= 0)


def test_same_seed_same_samples_and_different_seeds_differ(engine, prompts):
    first = sample(engine, prompts, seed=7)
    again = sample(engine, prompts, seed=7)
    other = sample(engine, prompts, seed=8)
    ids = lambda out: [[g.response_ids for g in group] for group in out]  # noqa: E731
    assert ids(first) == ids(again)
    assert ids(first) != ids(other)
    for a, b in zip(first, again, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x.sampled_logprobs, y.sampled_logprobs)


def test_samples_do_not_depend_on_batch_composition(checkpoint, engine, prompts):
    path, _ = checkpoint
    one_at_a_time = EmbeddedEngine(str(path), max_batch_size=1)
    batched = sample(engine, prompts, seed=3)
    single = sample(one_at_a_time, prompts, seed=3)
    alone = sample(one_at_a_time, prompts[1:2], seed=3)  # prompt index 0 here: a different stream
    assert [[g.response_ids for g in grp] for grp in batched] == [[g.response_ids for g in grp] for grp in single]
    for a, b in zip(batched, single, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_allclose(x.topk_logprobs, y.topk_logprobs, atol=1e-5)
    assert [g.response_ids for g in alone[0]] == [g.response_ids for g in sample(engine, [prompts[1]], seed=3)[0]]


def test_samples_within_a_group_differ(engine, prompts):
    out = sample(engine, prompts, n=4, temperature=1.5)
    assert any(len({tuple(g.response_ids) for g in group}) > 1 for group in out)


def test_greedy_is_the_argmax_continuation_of_a_full_forward(engine, prompts):
    out = sample(engine, prompts, n=2, temperature=0.0, max_new_tokens=8)
    for prompt, group in zip(prompts, out, strict=True):
        assert group[0].response_ids == group[1].response_ids
        gen = group[0]
        logprobs = full_logprobs(engine, prompt, gen.response_ids)
        assert logprobs.argmax(dim=-1).tolist() == gen.response_ids
        np.testing.assert_array_equal(gen.topk_ids[:, 0], gen.response_ids)


def test_logprobs_match_a_full_forward_log_softmax(engine, prompts):
    out = sample(engine, prompts, top_k_logprobs=7, temperature=1.3, top_p=0.9, seed=11)
    for prompt, group in zip(prompts, out, strict=True):
        for gen in group:
            logprobs = full_logprobs(engine, prompt, gen.response_ids)  # raw distribution, temperature 1
            ids = torch.as_tensor(gen.topk_ids, dtype=torch.long)
            np.testing.assert_allclose(gen.topk_logprobs, logprobs.gather(-1, ids).numpy(), atol=1e-5)
            np.testing.assert_allclose(gen.topk_logprobs, logprobs.topk(7).values.numpy(), atol=1e-5)
            sampled = logprobs.gather(-1, torch.tensor(gen.response_ids)[:, None])[:, 0]
            np.testing.assert_allclose(gen.sampled_logprobs, sampled.numpy(), atol=1e-5)


def test_stop_token_ends_the_sequence_and_is_kept(engine, prompts):
    greedy = sample(engine, prompts, n=1, temperature=0.0, max_new_tokens=8)
    reference = greedy[1][0].response_ids
    stop = reference[2]
    cut = reference.index(stop) + 1
    out = sample(engine, prompts, n=1, temperature=0.0, max_new_tokens=8, stop_token_ids=[stop])
    gen = out[1][0]
    assert gen.response_ids == reference[:cut]
    assert gen.finish_reason == "stop"
    assert gen.topk_ids.shape[0] == cut
    for group, full in zip(out, greedy, strict=True):  # the other rows of the batch are unaffected
        ids = full[0].response_ids
        expected = ids[: ids.index(stop) + 1] if stop in ids else ids
        assert group[0].response_ids == expected
        assert group[0].finish_reason == ("stop" if stop in ids else "length")


def test_rows_that_stop_leave_the_decode_and_no_sample_changes(checkpoint, prompts):
    """Rows that have stopped are dropped from the decode (with their KV cache) once an eighth of
    the batch has stopped: the batch the model sees shrinks, and every sample is what it is when
    decoded alone."""
    path, _ = checkpoint
    batched, alone = EmbeddedEngine(str(path), max_batch_size=64), EmbeddedEngine(str(path), max_batch_size=1)
    # a stop id that some rows draw early and others late or never: the commonest second token
    probe = sample(alone, prompts, n=4, max_new_tokens=12, seed=5)
    seconds = [g.response_ids[1] for group in probe for g in group]
    stop = max(set(seconds), key=seconds.count)
    together, widths = sample_with_widths(batched, prompts, n=4, max_new_tokens=12, seed=5, stop_token_ids=[stop])
    single = sample(alone, prompts, n=4, max_new_tokens=12, seed=5, stop_token_ids=[stop])
    lengths = sorted(len(g.response_ids) for group in together for g in group)
    assert lengths[0] < lengths[-1], lengths  # rows stopped at different steps
    assert widths[0] == 12 and min(widths) < 12 and widths == sorted(widths, reverse=True), widths
    assert_same_samples(together, single)
    batched.close()
    alone.close()


def test_the_static_loop_moves_stopped_rows_to_smaller_buckets_and_no_sample_changes(checkpoint, prompts):
    """The loop a GPU captures keeps fixed batch sizes: rows that stopped leave in buckets (every 16
    steps at most), filled up with finished rows, and every sample is still the eager loop's."""
    from tasks.engines.graph_decode import BUCKETS

    path, _ = checkpoint
    static = EmbeddedEngine(str(path), max_batch_size=64, decode="static")
    eager = EmbeddedEngine(str(path), max_batch_size=1, decode="eager")
    probe = sample(eager, prompts, n=4, max_new_tokens=40, seed=5)
    # a stop id that rows draw at different steps: the commonest token among the first ten
    firsts = [t for group in probe for g in group for t in g.response_ids[:10]]
    stop = max(set(firsts), key=firsts.count)
    together, widths = sample_with_widths(static, prompts, n=4, max_new_tokens=40, seed=5, stop_token_ids=[stop])
    single = sample(eager, prompts, n=4, max_new_tokens=40, seed=5, stop_token_ids=[stop])
    lengths = sorted(len(g.response_ids) for group in together for g in group)
    assert lengths[0] < 16 and lengths[-1] > 16, lengths  # some rows stop before the first bucket check
    assert widths[0] == 12 and min(widths) < 12 and widths == sorted(widths, reverse=True), widths
    assert set(widths[1:]) <= set(BUCKETS) | {12}, widths
    assert_same_samples(together, single)
    static.close()
    eager.close()


def test_the_bounded_decode_attention_equals_sdpa_over_each_rows_columns():
    """The captured step's attention reads columns [start_b, end) of a full-capacity cache: it equals
    SDPA over just those columns, with grouped query heads."""
    from tasks.engines.decode_attention import decode_attention

    torch.manual_seed(0)
    b, g, r, capacity, d = 3, 2, 3, 20, 8
    q = torch.randn(b, g * r, 1, d)
    k, v = torch.randn(b, g, capacity, d), torch.randn(b, g, capacity, d)
    start, end = torch.tensor([0, 4, 9]), torch.tensor([15])
    out = decode_attention(q, k, v, start, end, d**-0.5)  # [B, 1, h, d]
    for row in range(b):
        cols = slice(int(start[row]), int(end))
        keys = k[row, :, cols].repeat_interleave(r, dim=0)  # [h, s, d]
        values = v[row, :, cols].repeat_interleave(r, dim=0)
        expected = torch.nn.functional.scaled_dot_product_attention(q[row], keys, values)  # [h, 1, d]
        torch.testing.assert_close(out[row, 0], expected[:, 0], atol=1e-5, rtol=1e-5)


def test_every_token_a_stop_token_gives_one_token_responses(engine, prompts):
    vocab = engine.model.config.vocab_size
    out = sample(engine, prompts, stop_token_ids=list(range(vocab)))
    assert all(len(g.response_ids) == 1 and g.finish_reason == "stop" for group in out for g in group)


def test_max_new_tokens_gives_length(engine, prompts):
    out = sample(engine, prompts, max_new_tokens=3)
    assert all(len(g.response_ids) == 3 and g.finish_reason == "length" for group in out for g in group)


def test_tiny_top_p_is_greedy(engine, prompts):
    greedy = sample(engine, prompts, n=1, temperature=0.0)
    nucleus = sample(engine, prompts, n=4, temperature=2.0, top_p=1e-6)
    for g_group, n_group in zip(greedy, nucleus, strict=True):
        assert all(g.response_ids == g_group[0].response_ids for g in n_group)


def test_top_p_samples_stay_inside_the_nucleus(engine, prompts):
    vocab = engine.model.config.vocab_size
    top_p = 0.6
    out = sample(engine, prompts, n=8, top_p=top_p, top_k_logprobs=vocab, max_new_tokens=4, seed=5)
    for group in out:
        for gen in group:
            probs = np.exp(gen.topk_logprobs.astype(np.float64))  # [T, V], sorted descending
            before = np.cumsum(probs, axis=1) - probs
            for t, token in enumerate(gen.response_ids):
                nucleus = set(gen.topk_ids[t][before[t] < top_p].tolist())
                assert token in nucleus


def test_sampling_frequencies_follow_the_tempered_distribution(checkpoint, prompts):
    path, _ = checkpoint
    engine = EmbeddedEngine(str(path), max_batch_size=512)
    vocab = engine.model.config.vocab_size
    for temperature in (1.0, 2.0):
        out = sample(engine, [prompts[0]], n=2000, temperature=temperature, max_new_tokens=1, top_k_logprobs=vocab)
        first = out[0][0]
        probs = np.zeros(vocab)
        probs[first.topk_ids[0]] = np.exp(first.topk_logprobs[0] / temperature)
        probs /= probs.sum()
        counts = np.bincount([g.response_ids[0] for g in out[0]], minlength=vocab)
        top = np.argsort(probs)[::-1][:3]
        for token in top:  # within 4.5 standard deviations of the binomial count
            sd = np.sqrt(2000 * probs[token] * (1 - probs[token]))
            assert abs(counts[token] - 2000 * probs[token]) <= 4.5 * sd + 1


def test_load_weights_switches_weights_and_version(tmp_path, checkpoint, prompts):
    path, _ = checkpoint
    other = tmp_path / "other"
    make_checkpoint(other, seed=1, sharpness=40.0)
    engine = EmbeddedEngine(str(path), max_batch_size=4)
    before = sample(engine, prompts, temperature=0.0, n=1)
    version = engine.weight_version
    engine.load_weights(str(other))
    assert engine.weight_version != version
    after = sample(engine, prompts, temperature=0.0, n=1)
    assert [g[0].response_ids for g in before] != [g[0].response_ids for g in after]
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        sample(engine, prompts)


def test_prompt_longer_than_the_position_limit_is_rejected(engine):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        sample(engine, [[5] * 60], max_new_tokens=8)


def test_missing_checkpoint_is_rejected(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        EmbeddedEngine(str(tmp_path), max_batch_size=1)


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_the_inverse_cdf_gives_each_token_exactly_its_share_of_evenly_spread_uniforms(top_p):
    """Closed form: with uniforms (k + 0.5) / N, token i is drawn N * p_i times (within one) where
    p is the softmax, renormalised inside the nucleus for top-p; a token without mass never is."""
    from tasks.engines.sampling import draw as _sample

    logits = torch.tensor([0.3, -1.0, 2.0, float("-inf"), 0.7, 1.5, -0.2, 1.1], dtype=torch.float64)
    draws = 20_000
    u = (torch.arange(draws, dtype=torch.float64) + 0.5) / draws
    counts = torch.bincount(_sample(logits.expand(draws, -1), top_p=top_p, u=u), minlength=len(logits))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        order = probs.argsort(descending=True)
        inside = (probs[order].cumsum(0) - probs[order]) < top_p
        kept = torch.zeros_like(probs)
        kept[order[inside]] = probs[order[inside]]
        probs = kept / kept.sum()
    assert torch.all((counts - draws * probs).abs() <= 1), (counts, draws * probs)
    assert counts[3] == 0


def test_a_cache_with_transposed_keys_hands_out_the_same_keys_and_values():
    """The CPU's key layout [B, g, d, capacity] against the plain one, through a prompt, decode steps
    and a row selection: the same [B, g, s, d] views, which the decode attention reads alike."""
    from tasks.engines.decoding import PreallocatedLayer, _attention

    gen = torch.Generator().manual_seed(5)
    b, g, d, capacity = 4, 2, 8, 12
    plain, transposed = PreallocatedLayer(capacity), PreallocatedLayer(capacity, keys_transposed=True)
    steps = [5, 1, 1, 1]  # a 5-token prompt, then one position a step
    module = torch.nn.Module().eval()
    for i, n in enumerate(steps):
        rows = b if i < 2 else 2
        k, v = torch.randn(2, rows, g, n, d, generator=gen, dtype=torch.float64)
        if i == 2:  # rows 1 and 3 finished: both caches keep rows 0 and 2
            for layer in (plain, transposed):
                layer.batch_select_indices(torch.tensor([0, 2]))
        got, want = transposed.update(k, v), plain.update(k, v)
        assert transposed.key_buffer.shape[-1] == capacity and transposed.keys.stride(-2) == 1
        for a, z in zip(got, want, strict=True):
            assert a.shape == z.shape == (rows, g, sum(steps[: i + 1]), d)
            assert torch.equal(a, z)
        query = torch.randn(rows, 2 * g, 1, d, generator=gen, dtype=torch.float64)
        out_t, _ = _attention(module, query, *got, None, scaling=0.4)
        out_p, _ = _attention(module, query, *want, None, scaling=0.4)
        torch.testing.assert_close(out_t, out_p, rtol=1e-12, atol=1e-12)


def test_cpu_decode_attention_equals_sdpa_with_grouped_heads_and_padding():
    """The decode step's grouped GEMMs (tasks/engines/decoding.py) against torch SDPA on the
    same strided cache views, with 3 query heads per KV head and left padding."""
    from torch.nn import functional as F

    from tasks.engines.decoding import _attention

    gen = torch.Generator().manual_seed(3)
    b, h, g, s, d, capacity = 3, 6, 2, 9, 8, 16
    buffer = torch.randn(2, b, g, capacity, d, generator=gen, dtype=torch.float64)
    key, value = buffer[0][:, :, :s], buffer[1][:, :, :s]  # views of a preallocated cache
    query = torch.randn(b, h, 1, d, generator=gen, dtype=torch.float64)
    mask = torch.ones(b, 1, 1, s, dtype=torch.bool)
    mask[0, ..., :4] = False  # row 0 is left-padded by 4
    module = torch.nn.Module().eval()
    out, _ = _attention(module, query, key, value, mask, scaling=0.3)
    want = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=1e-12, atol=1e-12)


def test_a_decode_step_keeps_no_tensor_of_its_own_alive(checkpoint, prompts):
    """Each step's outputs go into buffers of the whole batch: as many tensors are alive at the 35th
    decode step as at the 5th. Per-step tensors kept in lists (5 a step) fragmented the heap between
    the steps' large temporaries: at 512 rows x 256 tokens the process's peak RSS grew by 150-590 MB
    over a call instead of ~140 MB (docs/changelog.md)."""
    import gc

    path, _ = checkpoint
    engine = EmbeddedEngine(str(path), max_batch_size=16)
    calls: list[int] = []
    live: dict[int, int] = {}

    def count_live_tensors(*_):
        calls.append(1)
        if len(calls) in (6, 36):  # the prompt's forward, then decode steps 5 and 35
            live[len(calls)] = sum(issubclass(type(o), torch.Tensor) for o in gc.get_objects())

    handle = engine.model.register_forward_hook(count_live_tensors)
    try:
        sample(engine, prompts, max_new_tokens=40, stop_token_ids=[])
    finally:
        handle.remove()
        engine.close()
    assert len(calls) == 40  # the prompt's forward and 39 decode steps
    assert live[36] == live[6], live


def test_decoding_runs_without_the_megatron_cpu_device_rewrite(checkpoint, prompts):
    """A process that trains with Megatron on the CPU has a CUDA->CPU torch function mode entered
    (a Python hook on every torch call, ~15 % of a decode loop); the engine's steps run without it,
    and the mode is back afterwards."""
    from torch.overrides import _get_current_function_mode

    from tasks.megatron.parallel import init_parallel

    init_parallel(tensor_parallel=1, seed=0)
    rewrite = _get_current_function_mode()
    assert rewrite is not None
    path, _ = checkpoint
    engine = EmbeddedEngine(str(path), max_batch_size=16)
    modes = []
    handle = engine.model.register_forward_hook(lambda *_: modes.append(_get_current_function_mode()))
    try:
        sample(engine, prompts, max_new_tokens=4)
    finally:
        handle.remove()
        engine.close()
    assert modes and all(mode is None for mode in modes)
    assert _get_current_function_mode() is rewrite
