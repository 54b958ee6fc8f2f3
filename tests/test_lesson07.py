"""Lesson 07: the exercise checks pass on the engine's tensor-parallel layers and shard (2 forked gloo ranks),
each untouched stub fails its own check, and the check helper reports a failing rank instead of hanging
(the engine itself, spawned workers and all, is tested in test_tensor_parallel.py)."""
import functools
import time

import pytest
import torch
import torch.distributed as dist
from lesson_source import generated_lesson

from nanoserve.checks import lesson07 as checks
from nanoserve.model import tp_layers


def exercises(ns):
    """Name -> the check run on ns's implementation (the table: checks.EXERCISES, shared with `make check`)."""
    return {name: functools.partial(check, ns) for name, check in checks.EXERCISES.items()}


ENGINE = vars(tp_layers)


@pytest.mark.parametrize("name", list(exercises(ENGINE)))
def test_engine_passes_check(name):
    exercises(ENGINE)[name]()


@pytest.mark.parametrize("name", list(exercises(ENGINE)))
def test_untouched_stub_fails_its_check(name):
    ns = {"__name__": "lesson07"}
    for cell in generated_lesson("07_tensor_parallel")["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and source.startswith("#| export"):
            exec(compile(source, "lesson07", "exec"), ns)
    number = name.split()[0]
    if number == "7.3":  # isolate the checkpoint_slices stub: the layers (7.1, 7.2) solved
        ns["RowParallelLinear"].forward = tp_layers.RowParallelLinear.forward
        ns["VocabParallelEmbedding"].forward = tp_layers.VocabParallelEmbedding.forward
    with pytest.raises(NotImplementedError, match=f"Exercise {number}"):
        exercises(ns)[name]()


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
