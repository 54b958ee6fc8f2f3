"""Lesson 04: prefix caching. Randomized pool invariants, outputs unchanged (exercise checks: test_exercises.py)."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nanoserve.cache import prefix as prefix_cache
from nanoserve.cache.block_manager import OutOfBlocks
from nanoserve.checks import lesson04 as checks
from nanoserve.checks.lesson04 import admit, pool_problems
from nanoserve.cache.prefix import PrefixCachingBlockManager, block_hash


def test_engine_outputs_unchanged_and_fewer_tokens_computed():
    checks.check_prefix_generate(prefix_cache.PrefixCachingKVCache)


STEMS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5]]


class SharedPrefixPool(RuleBasedStateMachine):
    """Random allocate/append/free with heavy prefix overlap, against the pool's invariants."""

    def __init__(self):
        super().__init__()
        self.bm = PrefixCachingBlockManager(num_blocks=16, block_size=2)
        self.live: dict[int, list[int]] = {}
        self.next_id = 0

    @rule(stem=st.sampled_from(STEMS), cut=st.integers(1, 9), tail=st.lists(st.integers(0, 3), max_size=4))
    def allocate(self, stem, cut, tail):
        tokens = stem[:cut] + tail
        seq, self.next_id = self.next_id, self.next_id + 1
        try:
            cached = self.bm.allocate_prompt(seq, tokens)
        except OutOfBlocks:
            return
        self.bm.commit(seq, tokens, len(tokens))  # a finished prefill step
        assert cached % 2 == 0 and cached <= len(tokens) - 1  # whole blocks; the last token is computed
        self.live[seq] = list(tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), new=st.lists(st.integers(0, 3), min_size=1, max_size=3))
    def append(self, data, new):
        seq = data.draw(st.sampled_from(sorted(self.live)))
        try:
            self.bm.append(seq, len(new))
        except OutOfBlocks:
            return
        self.live[seq] += new
        self.bm.commit(seq, self.live[seq], len(self.live[seq]))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.live)))
        self.bm.free(seq)
        del self.live[seq]
        with pytest.raises(KeyError):
            self.bm.free(seq)

    @invariant()
    def consistent(self):
        assert pool_problems(self.bm) == []
        for h, block in self.bm.cached.items():  # no cached hash names a block holding other tokens
            assert self.bm.records[block].hash == h and len(self.bm.records[block].tokens) == 2
        for seq, tokens in self.live.items():  # every full block of a live sequence holds its tokens
            table = self.bm.block_tables[seq]
            parent = None
            for i in range(len(tokens) // 2):
                parent = block_hash(parent, tokens[2 * i:2 * i + 2])
                assert self.bm.records[table[i]].tokens == tuple(tokens[2 * i:2 * i + 2])
                assert self.bm.records[table[i]].hash == parent

    def teardown(self):
        for seq in list(self.live):
            self.bm.free(seq)
        assert self.bm.num_free == 16 and not any(self.bm.ref_count)


TestSharedPrefixPool = SharedPrefixPool.TestCase
TestSharedPrefixPool.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)


def test_a_forced_hash_collision_never_shares_a_wrong_block(monkeypatch):
    monkeypatch.setattr(prefix_cache, "block_hash", lambda parent, tokens: 42)  # every block collides
    bm = PrefixCachingBlockManager(num_blocks=8, block_size=2)
    admit(bm, "a", [1, 2, 3, 4, 5])
    assert admit(bm, "b", [6, 7, 8, 9, 10]) == 0
    assert admit(bm, "c", [1, 2, 7, 7, 7]) == 2  # the true match on the first block is still found


def test_equal_tokens_after_another_prefix_are_not_shared(monkeypatch):
    monkeypatch.setattr(prefix_cache, "block_hash", lambda parent, tokens: hash(tuple(tokens)))  # forgets the parent
    bm = PrefixCachingBlockManager(num_blocks=8, block_size=2)
    admit(bm, "a", [1, 2, 3, 4, 5])
    assert admit(bm, "b", [3, 4, 9]) == 0  # [3, 4] at positions 0-1 is not a's [3, 4] at positions 2-3
