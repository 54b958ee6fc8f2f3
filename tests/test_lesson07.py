"""Lesson 07: the check helper (2 forked gloo ranks; the exercise checks are in test_exercises.py) reports a failing rank instead of hanging
(the engine itself, spawned workers and all, is tested in test_tensor_parallel.py)."""
import time

import pytest
import torch
import torch.distributed as dist

from nanoserve.checks import lesson07 as checks


def _one_rank_fails(rank, size):
    if rank == 1:
        raise ValueError("rank 1 gives up")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a rank that never comes


def test_a_failing_rank_is_reported_at_once_and_its_peer_killed():
    start = time.monotonic()
    with pytest.raises(ValueError, match="rank 1 gives up"):
        checks.run_on_ranks(_one_rank_fails)
    assert time.monotonic() - start < 10  # not run_on_ranks' timeout: rank 0 was killed, not awaited


def test_ranks_return_their_values_in_rank_order():
    assert checks.run_on_ranks(lambda rank, size: (rank, size, dist.get_rank()), size=3) == [(0, 3, 0), (1, 3, 1),
                                                                                           (2, 3, 2)]
