"""`deterministic_kernels`: the training step runs under torch's deterministic algorithms, and the
process's own setting is back after it, whatever it was."""

from __future__ import annotations

import pytest
import torch

from tasks.megatron.trainer import deterministic_kernels


@pytest.fixture(autouse=True)
def _restore_torch_setting():
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_on_inside_the_block_and_off_again_after_it():
    torch.use_deterministic_algorithms(False)
    with deterministic_kernels(True):
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # an op without a fixed order raises
    assert not torch.are_deterministic_algorithms_enabled()


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
