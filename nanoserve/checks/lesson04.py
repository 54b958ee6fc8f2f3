"""Checks for lesson 04 (prefix caching). Oracles: the plain hash chain, pool invariants, and the
paged cache without prefix caching (lesson 03)."""
import random
from collections import Counter

from nanoserve.checks.lesson01 import TINY_CONFIGS, hf_tiny_model, ours_from_hf
from nanoserve.checks.lesson03 import random_workload


def check_prefix_hashes(prefix_hashes) -> None:
    from nanoserve.cache.prefix import block_hash

    rng = random.Random(17)
    for n, size in [(0, 4), (3, 4), (4, 4), (11, 4), (64, 16)]:
        tokens = [rng.randrange(1000) for _ in range(n)]
        want, parent = [], None
        for i in range(n // size):
            parent = block_hash(parent, tokens[i * size:(i + 1) * size])
            want.append(parent)
        got = list(prefix_hashes(tokens, size))
        if len(got) != len(want):
            raise AssertionError(f"{len(got)} hashes for {n} tokens in blocks of {size}, want {len(want)}: one per "
                                 f"FULL block (a trailing partial block gets none)")
        for i, (h, w) in enumerate(zip(got, want)):
            if h != w:
                parent = "None" if i == 0 else f"hash {i - 1}"
                raise AssertionError(f"hash {i} of {n} tokens in blocks of {size} is not block_hash({parent}, tokens "
                                     f"{i * size}..{(i + 1) * size - 1}): chain each block's hash on the previous one "
                                     f"(None for the first)")
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [9, 2, 3, 4, 5, 6, 7, 8]
    if prefix_hashes(a, 4)[1] == prefix_hashes(b, 4)[1]:
        raise AssertionError("block 1 has the same hash after a different block 0: chain each hash on its parent")
    print("✓ prefix_hashes: one chained hash per full block")


def pool_problems(bm) -> list[str]:
    """Invariants of a PrefixCachingBlockManager."""
    problems = []
    holders = Counter(b for table in bm.block_tables.values() for b in table)
    free = list(bm.free_blocks) + list(bm.evictable)
    if len(set(free)) != len(free):
        problems.append("a block is free twice")
    for b in range(bm.num_blocks):
        if bm.ref_count[b] != holders[b]:
            problems.append(f"block {b}: ref_count {bm.ref_count[b]} but {holders[b]} block tables hold it")
        if (b in free) == (holders[b] > 0):
            problems.append(f"block {b} is {'both free and used' if holders[b] else 'neither free nor used'}")
    for h, b in bm.cached.items():
        if bm.records[b].hash != h:
            problems.append(f"cached hash {h} points to block {b}, whose hash is {bm.records[b].hash}")
    for b in bm.free_blocks:
        if bm.records[b].hash is not None:
            problems.append(f"block {b} is free (not evictable) but still named")
    for b in bm.evictable:
        if bm.records[b].hash is None:
            problems.append(f"block {b} is evictable but has no name (hash None): nothing can find it, so it is "
                            f"simply free (free_blocks)")
    return problems


def admit(bm, seq, tokens) -> int:
    """Allocate a prompt, then commit it as a finished prefill step would; returns the cached tokens."""
    cached = bm.allocate_prompt(seq, tokens)
    bm.commit(seq, tokens, len(tokens))
    return cached


PROMPT = list(range(100, 110))  # 10 tokens: blocks of 4 -> [4 full][4 full][2]


def _admit_four(bm, on_lookup: bool) -> None:
    """Four prompts into a pool of 10 blocks of 4, as a server would admit them: a new one, an exact duplicate,
    its first 8 tokens, a different one. on_lookup: say a wrong cached count (exercise 4.2's answer)."""
    checks = [("a new prompt", "a", PROMPT, 0), ("an exact duplicate", "b", PROMPT, 8),
              ("the first 8 tokens (its last token is recomputed)", "c", PROMPT[:8], 4),
              ("a different prompt", "d", [7] * 10, 0)]
    for what, seq, tokens, cached in checks:
        got = admit(bm, seq, tokens)
        if got != cached and on_lookup:
            raise AssertionError(f"allocate_prompt for {what} reported {got} cached tokens, want {cached}")
        if pool_problems(bm):
            raise AssertionError(f"after allocating {what}: {pool_problems(bm)}")


def _random_workload(manager_cls) -> None:
    """Heavy overlap, against the invariants; every block free at the end."""
    rng = random.Random(1)
    bm = manager_cls(num_blocks=30, block_size=3)
    stems = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    live = random_workload(bm, 500, rng, admit=admit, problems=lambda bm, live: pool_problems(bm),
                           draw_prompt=lambda rng: rng.choice(stems)[: rng.randint(1, 12)]
                           + [rng.randrange(50) for _ in range(rng.randint(0, 5))])
    for seq in list(live):
        bm.free(seq)
    if bm.num_free != 30:
        raise AssertionError(f"{30 - bm.num_free} of 30 blocks leaked after all sequences finished")


def check_prefix_lookup(manager_cls) -> None:
    """Exercise 4.2, cached_prefix, through allocate_prompt: which blocks a prompt finds. Blocks are given back
    by the package's _return_blocks (exercise 4.3's), so only the lookup is checked here."""
    from nanoserve.cache.prefix import PrefixCachingBlockManager, block_hash
    from nanoserve.checks import with_reference

    manager_cls = with_reference(manager_cls, PrefixCachingBlockManager, "_return_blocks", own_globals=False)
    bm = manager_cls(num_blocks=10, block_size=4)
    _admit_four(bm, on_lookup=True)
    if bm.block_tables["a"][:2] != bm.block_tables["b"][:2] or bm.ref_count[bm.block_tables["a"][0]] != 3:
        raise AssertionError("a duplicate must share the first blocks, and each shared block counts its holders")
    early = manager_cls(num_blocks=10, block_size=4)
    early.allocate_prompt("u", PROMPT)  # allocated, never committed: its step never finished
    if early.allocate_prompt("v", PROMPT) != 0:
        raise AssertionError("a block was found before a finished step committed its K/V")
    for seq in "abcd":
        bm.free(seq)
    if admit(bm, "e", PROMPT) != 8:
        raise AssertionError("a finished sequence's blocks (evictable now) must still be found")
    bm.free("e")
    # A forged cache entry (a hash collision) must not be trusted: the tokens are compared.
    other = list(range(500, 510))
    bm.cached[block_hash(None, other[:4])] = bm.cached[block_hash(None, PROMPT[:4])]
    if admit(bm, "f", other) != 0:
        raise AssertionError("a block was shared on a hash match whose tokens differ (compare the record's tokens)")
    bm.free("f")
    # The same tokens after a different prefix are different K/V: a forged match on them must fail too.
    mixed = list(range(200, 204)) + PROMPT[:4] + [1, 2]
    admit(bm, "g", mixed[:5])  # caches mixed's first block
    bm.free("g")
    bm.cached[block_hash(block_hash(None, mixed[:4]), mixed[4:8])] = bm.cached[block_hash(None, PROMPT[:4])]
    if admit(bm, "h", mixed) != 4:
        raise AssertionError("a block was shared on a hash match whose parent differs (compare the parent hash too)")
    bm.free("h")
    # The chain is walked from its first block: a prompt finds the cached blocks of its longest cached prefix.
    bm = manager_cls(num_blocks=5, block_size=2)
    admit(bm, "x", [1, 2, 3, 4, 5, 6, 7])  # a chain of three full blocks, and a partial one
    bm.free("x")
    admit(bm, "z", list(range(20, 26)))  # 3 blocks: the 2 free ones, then one eviction (the chain's last)
    bm.free("z")
    if admit(bm, "w", [1, 2, 3, 4, 9]) != 4:
        raise AssertionError("a prompt whose first two blocks are cached (the third was evicted) must find them")
    _random_workload(manager_cls)


def check_prefix_free(manager_cls) -> None:
    """Exercise 4.3, _return_blocks, through free: reference counts, named blocks kept findable (evictable, LRU,
    deepest first), unnamed ones simply free. Prompts find their blocks by the package's cached_prefix
    (exercise 4.2's), so only the giving back is checked here."""
    from nanoserve.cache.prefix import PrefixCachingBlockManager, block_hash
    from nanoserve.checks import with_reference

    manager_cls = with_reference(manager_cls, PrefixCachingBlockManager, "cached_prefix", own_globals=False)
    bm = manager_cls(num_blocks=10, block_size=4)
    _admit_four(bm, on_lookup=False)
    for seq in "abcd":
        bm.free(seq)
        if pool_problems(bm):
            raise AssertionError(f"after freeing {seq!r}: {pool_problems(bm)}")
    if bm.num_free != 10:
        raise AssertionError(f"{bm.num_free} of 10 blocks free after every sequence finished")
    if admit(bm, "e", PROMPT) != 8:
        raise AssertionError("a finished sequence's named blocks stay cached (evictable) until their space is needed")
    bm.free("e")
    # LRU: when no never-used block is left, the least recently freed cached block goes first.
    bm = manager_cls(num_blocks=5, block_size=2)
    for seq, tokens in [("x", [1, 2, 3]), ("y", [4, 5, 6])]:  # each: one full (cached) block + one partial
        admit(bm, seq, tokens)
    bm.free("x")
    bm.free("y")  # evictable now: x's full block, then y's
    admit(bm, "z", list(range(7, 15)))  # 4 blocks: the 3 uncached free ones, then one eviction
    if block_hash(None, [1, 2]) in bm.cached or block_hash(None, [4, 5]) not in bm.cached:
        raise AssertionError("eviction must take the least recently freed cached block (x's) first")
    # Within one sequence the deepest block is evicted first: what is left of its chain stays findable
    # (evicting the first block would make every later one unreachable, though still cached).
    bm = manager_cls(num_blocks=5, block_size=2)
    admit(bm, "x", [1, 2, 3, 4, 5, 6, 7])  # a chain of three full blocks, and a partial one
    bm.free("x")
    admit(bm, "z", list(range(20, 26)))  # 3 blocks: the 2 free ones (never used, x's partial), one eviction
    first = block_hash(None, [1, 2])
    second = block_hash(first, [3, 4])
    if block_hash(second, [5, 6]) in bm.cached or first not in bm.cached or second not in bm.cached:
        raise AssertionError("a finished sequence's blocks must be evicted deepest first (return them in reverse "
                             "order): its first blocks, the ones other prompts share, stay cached longest")
    # A block without a name is free at once: it is reused before any cached block is evicted.
    bm = manager_cls(num_blocks=3, block_size=2)
    admit(bm, "x", [1, 2, 3])  # a named block and a partial one
    admit(bm, "y", [9])  # a partial one: the pool is full
    bm.free("x")
    bm.free("y")
    admit(bm, "z", [7, 8, 9, 10])  # 2 blocks: the two partial ones, free; x's named block stays cached
    if block_hash(None, [1, 2]) not in bm.cached:
        raise AssertionError("a cached block was evicted while blocks without a name were unused: give an unnamed "
                             "block back to free_blocks, not to evictable")
    _random_workload(manager_cls)


def check_prefix_manager(manager_cls) -> None:
    """The lesson's check of its manager: exercise 4.2's lookup, then exercise 4.3's giving back."""
    check_prefix_lookup(manager_cls)
    check_prefix_free(manager_cls)
    print("✓ prefix-caching manager: sharing after commit, reference counts, collision guard, LRU eviction, "
          "500 random operations")


def check_prefix_generate(cache_cls) -> None:
    from nanoserve.course.counting import count_tokens
    from nanoserve.course.generate import generate
    from nanoserve.model.qwen3 import Qwen3ForCausalLM
    from nanoserve.cache.paged import PagedKVCache
    from nanoserve.engine.sampling_params import SamplingParams

    model = ours_from_hf(Qwen3ForCausalLM, hf_tiny_model(**TINY_CONFIGS["qwen3 group=2 head_dim=128"], seed=18, tie=False))
    rng = random.Random(19)
    system = [rng.randrange(512) for _ in range(13)]
    params = SamplingParams(temperature=0, max_tokens=6)

    def run(cache_factory, rounds):
        """Generate each round's prompts through one cache; returns outputs and prompt tokens computed."""
        cache, outputs, computed = cache_factory(), [], 0
        forwards = count_tokens(cache)
        for prompts in rounds(outputs):
            before = len(forwards)
            done, _ = generate(model, prompts, params, cache=cache)
            computed += forwards[before]
            outputs.append([c.token_ids for c in done])
        return outputs, computed

    def shared_system(_):  # blocks become shareable once the step computing them has finished
        users = [system + [rng_i] * k for rng_i, k in [(3, 2), (5, 7), (9, 1)]]
        yield users[:1]
        yield users[1:]

    duplicates = [[rng.randrange(512) for _ in range(11)]] * 3

    def exact_duplicates(_):
        yield duplicates[:1]
        yield duplicates

    chat = [system + [1, 2, 3], system + [4, 5]]

    def multi_turn(outputs):
        prompts = chat
        for turn in range(3):
            yield prompts
            prompts = [p + out + [7, 8, 9 + turn] for p, out in zip(prompts, outputs[-1])]

    first, second = [[rng.randrange(512) for _ in range(40)] for _ in range(2)]

    def evicted_between(_):  # with 16 blocks, the second prompt evicts part of the first's cached blocks
        yield [first]
        yield [second]
        yield [first]

    for name, rounds, blocks in [("shared system prompt", shared_system, 64), ("exact duplicates", exact_duplicates, 64),
                                 ("multi-turn chat", multi_turn, 64), ("eviction", evicted_between, 16)]:
        plain, plain_computed = run(lambda: PagedKVCache(model.config, num_blocks=blocks, block_size=4), rounds)
        cached, cached_computed = run(lambda: cache_cls(model.config, num_blocks=blocks, block_size=4), rounds)
        if cached != plain:
            raise AssertionError(f"{name}: outputs with prefix caching {cached} != without {plain}")
        if not cached_computed < plain_computed:
            raise AssertionError(f"{name}: prefix caching computed {cached_computed} prompt tokens, "
                                 f"no fewer than without ({plain_computed})")
    print("✓ prefix caching: identical greedy outputs (shared system prompt, duplicates, multi-turn, eviction), "
          "fewer prompt tokens computed")


# Every exercise of the lesson: its name -> the check, run on the implementation found in a namespace `ns`
# (the engine's modules in tests/, the learner's notebook cells in `make check`, tools/check_lessons.py).
EXERCISES = {
    "4.1 prefix_hashes": lambda ns: check_prefix_hashes(ns["prefix_hashes"]),
    "4.2 lookup on allocate": lambda ns: check_prefix_lookup(ns["PrefixCachingBlockManager"]),
    "4.3 reference-counted free": lambda ns: check_prefix_free(ns["PrefixCachingBlockManager"]),
}
