"""`deterministic_kernels`: the training step runs under torch's deterministic algorithms, and the
process's own setting is back after it, whatever it was."""

from __future__ import annotations

import pytest
import torch
import torch.utils.deterministic

from tasks.megatron.trainer import deterministic_kernels


@pytest.fixture(autouse=True)
def _restore_torch_setting():
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.utils.deterministic.fill_uninitialized_memory = fill


def test_on_inside_the_block_and_off_again_after_it():
    torch.use_deterministic_algorithms(False)
    with deterministic_kernels(True):
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # an op without a fixed order raises
    assert not torch.are_deterministic_algorithms_enabled()


def test_new_tensors_are_not_filled_inside_the_block_and_the_fill_setting_is_restored():
    torch.utils.deterministic.fill_uninitialized_memory = True
    with deterministic_kernels(True):
        assert not torch.utils.deterministic.fill_uninitialized_memory
        # torch.empty returns memory as it was: no NaN written into every new tensor
        fill_calls = _count_fills(lambda: torch.empty(1024, 1024))
        assert fill_calls == 0
    assert torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    assert _count_fills(lambda: torch.empty(1024, 1024)) == 1  # the mode alone fills (the oracle works)


def _count_fills(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(event.count for event in prof.key_averages() if event.key == "aten::fill_")


def test_a_setting_of_the_process_is_restored_even_after_an_error():
    torch.use_deterministic_algorithms(True, warn_only=True)
    with pytest.raises(ValueError, match="inside"), deterministic_kernels(True):
        raise ValueError("inside")
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.is_deterministic_algorithms_warn_only_enabled()


def test_disabled_leaves_the_setting_alone():
    torch.use_deterministic_algorithms(False)
    with deterministic_kernels(False):
        assert not torch.are_deterministic_algorithms_enabled()
