"""Lesson 07: the check helper (2 forked gloo ranks; the exercise checks are in test_exercises.py) reports a failing
rank instead of hanging, and check 7.3 fails on wrong slice plans (the engine itself, spawned workers and all, is
tested in test_tensor_parallel.py)."""
import time

import pytest
import torch
import torch.distributed as dist

from nanoserve.checks import lesson07 as checks
from nanoserve.model import tp_layers


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


RIGHT_PLAN = tp_layers.checkpoint_slices


def _plan_with(**wrong):
    """Exercise 7.3's plan with some entries replaced: kind -> (dimension, start) from (config, group, local, D)."""
    def plan(config, group):
        local = tp_layers.rank_config(config, group)
        out = RIGHT_PLAN(config, group)
        return out | {kind: entry(config, group, local, config.head_dim) for kind, entry in wrong.items()}
    return plan


def _kv(start):
    return {"k_proj": start, "v_proj": start}


WRONG_PLANS = {
    # K/V heads counted from the rank as if every rank had its own: right with at least as many K/V heads as
    # ranks, past the tensor's end with one K/V head at TP=2
    "K/V start from the rank's own K/V heads": (_kv(lambda c, g, local, D: (0, g.rank * local.num_kv_heads * D)),
                                               "1 K/V head at TP=2, rank 1 of 2: .*k_proj.*K/V head 0"),
    "K/V start where the query heads start": (_kv(lambda c, g, local, D: (0, g.rank * local.num_heads * D)),
                                             "rank 1 of 2: .*k_proj"),
    "K/V head 0 on every rank": (_kv(lambda c, g, local, D: (0, 0)), "rank 1 of 2: .*k_proj.*K/V heads 2-3"),
    "K/V head r // 2 (replication at TP=4 only)": (_kv(lambda c, g, local, D: (0, g.rank // 2 * D)),
                                                  "at TP=2, rank 1 of 2: .*k_proj"),
    "o_proj cut by rows": ({"o_proj": lambda c, g, local, D: (0, g.rank * local.num_heads * D)}, "o_proj|loading"),
    "down_proj from the query heads' start": ({"down_proj": lambda c, g, local, D: (1, g.rank * local.num_heads * D)},
                                             "down_proj"),
    "the vocabulary from 0 on every rank": ({"embed_tokens": lambda c, g, local, D: (0, 0)}, "embed_tokens"),
    "an untied LM head from 0": ({"lm_head": lambda c, g, local, D: (0, 0)}, "lm_head"),
}


@pytest.mark.parametrize("wrong", WRONG_PLANS, ids=list(WRONG_PLANS))
def test_check_7_3_catches_a_wrong_plan(wrong, monkeypatch):
    entries, message = WRONG_PLANS[wrong]
    monkeypatch.setattr(tp_layers, "checkpoint_slices", _plan_with(**entries))  # shard's global
    with pytest.raises(AssertionError, match=message):
        checks.check_checkpoint_slices(tp_layers.TPGroup, tp_layers.shard)


def test_expected_slices_of_a_replicated_kv_head():
    """2 K/V heads at TP=4: ranks 0 and 1 hold head 0, ranks 2 and 3 head 1; 1 K/V head at TP=2: both ranks hold it."""
    from types import SimpleNamespace

    k = torch.arange(2 * 4 * 3.0).view(8, 3)  # 2 K/V heads of head_dim 4, hidden 3
    config = SimpleNamespace(head_dim=4, num_heads=8, num_kv_heads=2, intermediate_size=8, vocab_size=10)
    heads = [checks.expected_slice("layers.0.self_attn.k_proj.weight", k, config, rank, 4)[0] for rank in range(4)]
    assert [h[0, 0].item() for h in heads] == [0, 0, 12, 12] and all(h.shape == (4, 3) for h in heads)
    config.num_kv_heads, k = 1, k[:4]
    assert all(torch.equal(checks.expected_slice("x.k_proj.weight", k, config, rank, 2)[0], k) for rank in range(2))
