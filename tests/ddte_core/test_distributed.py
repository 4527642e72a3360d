"""ddte_core.distributed: rank 0 told apart before and after the process group exists, and each rank's own data
(the distill windows; the selector's training share)."""

from __future__ import annotations

import pytest
import torch

import ddte_core.distributed as distributed
from ddte_core.distributed import RANK_VARIABLES, is_rank_zero, rank_seed


@pytest.fixture
def alone(monkeypatch):
    for name in RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(("variables", "zero"), [
    ({}, True),
    ({"LOCAL_RANK": "0", "NODE_RANK": "0"}, True),  # rank 0 after Lightning's launcher set its variables
    ({"LOCAL_RANK": "1"}, False),  # a process Lightning's launcher re-executed
    ({"LOCAL_RANK": "0", "NODE_RANK": "1"}, False),  # the first process of the second node
    ({"RANK": "3"}, False),  # torchrun
    ({"SLURM_PROCID": "2"}, False),  # srun
])
def test_rank_zero_before_the_process_group_exists(alone, variables, zero):
    for name, value in variables.items():
        alone.setenv(name, value)
    assert is_rank_zero() is zero


def test_each_rank_draws_its_own_windows(monkeypatch):
    from distill.data import RandomWindows

    stream = torch.arange(1000)
    windows = RandomWindows(stream, seq_len=8, batch_size=4, seed=5)
    batches = {}
    for rank in (0, 1, 2):
        monkeypatch.setattr(distributed, "_group_rank", lambda rank=rank: rank)
        batches[rank] = next(iter(windows))
    monkeypatch.setattr(distributed, "_group_rank", lambda: None)  # one process: what rank 0 draws
    assert torch.equal(next(iter(windows)), batches[0])
    assert rank_seed(5) == 5
    assert not torch.equal(batches[0], batches[1]) and not torch.equal(batches[1], batches[2])
