"""The output layer run at the scored positions alone gives the full forward's logits there and the
same gradients (tasks/megatron/output_rows.py)."""

from __future__ import annotations

import pytest
import torch

from tasks.megatron.output_rows import OutputRows

VOCAB = 97


@pytest.fixture(scope="module")
def hf_config():
    from tests.synthetic import tiny_qwen3_config

    return tiny_qwen3_config(VOCAB)


def twin_models(hf_config, *, fused_layout: bool):
    from tasks.megatron import fusions
    from tasks.megatron.model import build_gpt_model
    from tasks.megatron.parallel import init_parallel

    init_parallel(tensor_parallel=1, seed=21)
    plain = build_gpt_model(hf_config, parallel_output=False)
    rows_only = build_gpt_model(hf_config, parallel_output=False)
    rows_only.load_state_dict(plain.state_dict())
    if fused_layout:  # the GPU path's batch-first output layer under the row selection
        fusions.batch_first_logits(rows_only)
    return plain, rows_only, OutputRows(rows_only)


@pytest.mark.parametrize("fused_layout", [False, True])
def test_logits_at_the_rows_and_every_gradient_equal_the_full_forward(hf_config, fused_layout):
    plain, rows_only, selection = twin_models(hf_config, fused_layout=fused_layout)
    tokens = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(22))
    positions = torch.arange(9).expand(3, 9)
    rows = torch.tensor([2, 3, 4, 11, 12, 19, 20, 21, 25])  # flat b * 9 + s, three samples' responses
    weights = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(23))

    full = plain(tokens, positions, None)  # [3, 9, V]
    want = full.reshape(-1, VOCAB)[rows]
    (want.float().log_softmax(-1) * weights).sum().backward()

    seen = {}
    hidden = hf_config.hidden_size
    rows_only.output_layer.register_forward_hook(lambda m, args, out: seen.update(rows=args[0].numel() // hidden))
    with selection.only(rows):
        got = rows_only(tokens, positions, None)
    assert got.shape == (1, len(rows), VOCAB)
    assert seen["rows"] == len(rows)  # the projection ran on the selected rows alone
    (got.reshape(-1, VOCAB).float().log_softmax(-1) * weights).sum().backward()

    torch.testing.assert_close(got.reshape(-1, VOCAB), want, rtol=1e-6, atol=1e-6)
    for (name, p), (_, q) in zip(plain.named_parameters(), rows_only.named_parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_outside_the_block_the_model_projects_every_position(hf_config):
    plain, rows_only, selection = twin_models(hf_config, fused_layout=False)
    tokens = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(24))
    positions = torch.arange(7).expand(2, 7)
    with torch.no_grad():
        with selection.only(torch.tensor([0, 5])):
            assert rows_only(tokens, positions, None).shape == (1, 2, VOCAB)
        torch.testing.assert_close(rows_only(tokens, positions, None), plain(tokens, positions, None))


def test_one_selection_at_a_time_and_flat_rows_only(hf_config):
    _, _, selection = twin_models(hf_config, fused_layout=False)
    with pytest.raises(ValueError, match=r"flat positions \[N\]"):
        with selection.only(torch.zeros(2, 3, dtype=torch.long)):
            pass
    with selection.only(torch.tensor([1])):
        with pytest.raises(RuntimeError, match="already active"):
            with selection.only(torch.tensor([2])):
                pass
