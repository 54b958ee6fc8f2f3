"""Checks for lesson 05 (the scheduler). Oracles: hand-worked scheduling cases, and each prompt run alone."""
import random

from nanoserve.checks.lesson01 import TINY_CONFIGS, hf_tiny_model
from nanoserve.model.config import ModelConfig


def _tiny_config():
    return ModelConfig.from_hf(hf_tiny_model(**TINY_CONFIGS["qwen3 group=1 head_dim=64"], layers=1).config.to_dict())


def _seq(seq_id, n_prompt, max_tokens=8, world=None):
    """A sequence built with the Sequence class that `world` (the code under test's globals) knows."""
    from nanoserve.engine.sampling_params import SamplingParams
    from nanoserve.engine.sequence import Sequence

    return (world or {}).get("Sequence", Sequence)(seq_id, list(range(1, n_prompt + 1)), SamplingParams(temperature=0, max_tokens=max_tokens), 0)


def _run(scheduler, batch):
    """What the engine does after a step (the scheduler counted its tokens already): each sequence that
    samples gets its token, which resolves its placeholder."""
    for seq, sampled in zip(batch.seqs, batch.sampled):
        if sampled:
            seq.append(7)
            seq.num_placeholders -= 1


def check_scheduler(scheduler_cls) -> None:
    from nanoserve.cache.paged import PagedKVCache
    from nanoserve.checks import namespace_of

    world = namespace_of(scheduler_cls)  # the scheduler's own Sequence and SequenceStatus (a notebook's, in a lesson)
    SequenceStatus = world["SequenceStatus"]  # noqa: N806
    config = _tiny_config()
    # Chunked prefill: a 20-token prompt with a budget of 8 comes in chunks of 8, 8, 4, while an earlier
    # request keeps decoding beside it.
    s = scheduler_cls(PagedKVCache(config, num_blocks=64, block_size=4), max_num_seqs=4, max_num_batched_tokens=8)
    a, b = _seq(0, 3, world=world), _seq(1, 20, world=world)
    s.add(a)
    steps = []
    for i in range(4):
        if i == 1:
            s.add(b)
        batch = s.schedule()
        steps.append([(q.seq_id, n) for q, n in zip(batch.seqs, batch.num_new)])
        _run(s, batch)
    want = [[(0, 3)], [(0, 1), (1, 7)], [(0, 1), (1, 7)], [(0, 1), (1, 6)]]
    if steps != want:
        raise AssertionError(f"(sequence, tokens) per step: got {steps}, want {want}. Running sequences come first; "
                             f"a waiting prompt gets what is left of the budget; the rest of it comes in later steps.")
    # Several waiting prompts share one budget: each admitted prompt takes its tokens out of it.
    s = scheduler_cls(PagedKVCache(config, num_blocks=64, block_size=4), max_num_seqs=4, max_num_batched_tokens=8)
    for i in range(3):
        s.add(_seq(i, 5, world=world))
    batch = s.schedule()
    got = [(q.seq_id, n) for q, n in zip(batch.seqs, batch.num_new)]
    if got != [(0, 5), (1, 3)] or [q.seq_id for q in s.waiting] != [2]:
        raise AssertionError(f"three waiting 5-token prompts with a budget of 8: scheduled {got}, want [(0, 5), "
                             f"(1, 3)] with sequence 2 still waiting: each admission spends its tokens")
    # max_num_seqs: a third sequence waits while two run.
    s = scheduler_cls(PagedKVCache(config, num_blocks=64, block_size=4), max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        s.add(_seq(i, 5, world=world))
    batch = s.schedule()
    if [q.seq_id for q in batch.seqs] != [0, 1] or [q.seq_id for q in s.waiting] != [2]:
        raise AssertionError(f"with max_num_seqs=2, sequences {[q.seq_id for q in batch.seqs]} ran; want [0, 1]")
    # Preemption: two sequences fill the pool; when they need new blocks, the newer one is preempted.
    s = scheduler_cls(PagedKVCache(config, num_blocks=4, block_size=4), max_num_seqs=4, max_num_batched_tokens=64)
    a, b = _seq(0, 8, world=world), _seq(1, 8, world=world)
    s.add(a)
    s.add(b)
    _run(s, s.schedule())  # both prefilled: 4 blocks used, each sequence now has 9 tokens
    c = _seq(2, 8, world=world)
    s.add(c)  # it waits behind: no block is free
    batch = s.schedule()
    if [q.seq_id for q in batch.preempted] != [1] or [q.seq_id for q in batch.seqs] != [0]:
        raise AssertionError(f"out of blocks: preempted {[q.seq_id for q in batch.preempted]}, ran "
                             f"{[q.seq_id for q in batch.seqs]}; want sequence 1 (the newest) preempted, 0 running")
    if b in s.running or b.num_preemptions != 1:
        raise AssertionError(f"a preempted sequence leaves the running list and counts the preemption "
                             f"(num_preemptions {b.num_preemptions}, want 1)")
    if b.status is not SequenceStatus.PREEMPTED or b.num_computed != 0 or list(s.waiting) != [b, c]:
        raise AssertionError("a preempted sequence is PREEMPTED, has num_computed 0, and waits at the front "
                             "of the queue, before the sequences that were already waiting")
    if 1 in s.cache.block_manager.block_tables:
        raise AssertionError("a preempted sequence's blocks go back to the pool")
    print("✓ scheduler: running first, chunked prefill within the token budget, max_num_seqs, newest preempted")


def _batch(seqs_and_chunks):
    """A ScheduledBatch of (sequence, start, n): n new tokens from position start (placeholders past its tokens)."""
    from nanoserve.engine.scheduler import ScheduledBatch

    seqs, starts, nums = zip(*seqs_and_chunks)
    return ScheduledBatch(list(seqs), list(nums), list(starts))


def check_prepare_inputs(prepare_inputs) -> None:
    mid, last, decode, ahead = _seq(0, 10), _seq(1, 6), _seq(2, 3), _seq(3, 4)
    decode.append(9)  # decoding: token 9 at position 3
    ahead.append(8)
    ahead.num_placeholders = 1  # its token at position 5 was sampled by a step not processed yet
    got = prepare_inputs(_batch([(mid, 2, 4), (last, 4, 2), (decode, 3, 1), (ahead, 5, 1)]))
    want = [(0, 2, [3, 4, 5, 6]), (1, 4, [5, 6]), (2, 3, [9]), (3, 5, [0])]
    if list(map(tuple, got)) != want:
        raise AssertionError(f"prepare_inputs gave {got}, want {want}: (seq_id, first new position, new token ids) "
                             f"per sequence; a placeholder (a token past its token_ids) is 0")
    # Random batches: chunks that start and end anywhere, a placeholder at the end or not.
    rng = random.Random(5)
    for _ in range(80):
        chunks = []
        for i in range(rng.randint(1, 5)):
            seq = _seq(10 + i, rng.randint(1, 12))
            for _ in range(rng.choice([0, 0, 1, 3])):
                seq.append(rng.randint(0, 99))
            seq.num_placeholders = rng.choice([0, 0, 1])
            start = rng.randint(0, seq.length - 1)
            chunks.append((seq, start, rng.randint(1, seq.length - start)))
        want = [(q.seq_id, start, (q.token_ids + [0] * q.num_placeholders)[start:start + n]) for q, start, n in chunks]
        got = prepare_inputs(_batch(chunks))
        if list(map(tuple, got)) != want:
            raise AssertionError(f"prepare_inputs gave {got}, want {want}: each sequence's tokens from batch.starts[i], "
                                 f"batch.num_new[i] of them, a placeholder as 0")
    print("✓ prepare_inputs: each sequence's new tokens from its start, placeholders as 0")


def check_batch_invariance(engine_cls) -> None:
    import random

    from nanoserve.checks.lesson01 import ours_from_hf
    from nanoserve.model.qwen3 import Qwen3ForCausalLM
    from nanoserve.cache.paged import PagedKVCache
    from nanoserve.cache.prefix import PrefixCachingKVCache
    from nanoserve.engine.sampling_params import SamplingParams

    model = ours_from_hf(Qwen3ForCausalLM, hf_tiny_model(**TINY_CONFIGS["qwen3 group=2 head_dim=128"], seed=20, tie=False))
    rng = random.Random(21)
    system = [rng.randrange(512) for _ in range(9)]
    requests = []
    for i in range(32):  # different lengths and parameters; a third share a system prompt
        prompt = (system if i % 3 == 0 else []) + [rng.randrange(512) for _ in range(rng.randint(1, 30))]
        params = SamplingParams(temperature=0 if i % 4 else 0.8, seed=i, max_tokens=rng.randint(1, 12))
        requests.append((prompt, params))

    def run(cache, budget, reqs):
        engine = engine_cls(model, cache, max_num_seqs=16, max_num_batched_tokens=budget)
        seqs = [engine.add_request(p, sp) for p, sp in reqs]
        chunks = 0
        while engine.has_unfinished():
            chunks += sum(token is None for _, token in engine.step())
        preemptions = engine.stats.preemptions
        return [s.output_ids for s in seqs], preemptions, chunks, cache

    alone = [run(PagedKVCache(model.config, num_blocks=64, block_size=4), 256, [r])[0][0] for r in requests]
    for cache_cls in (PagedKVCache, PrefixCachingKVCache):
        cache = cache_cls(model.config, num_blocks=14, block_size=4)  # 56 token slots for 32 requests
        outputs, preemptions, chunks, cache = run(cache, 16, requests)
        for i, (got, want) in enumerate(zip(outputs, alone)):
            if got != want:
                raise AssertionError(f"{cache_cls.__name__}: request {i} gave {got} in the batch, {want} alone")
        if preemptions == 0 or chunks == 0:
            raise AssertionError(f"the test did not exercise preemption ({preemptions}) or chunked prefill ({chunks})")
        if cache.block_manager.block_tables or cache.block_manager.num_free != 14:
            raise AssertionError("blocks leaked: not every block is back in the pool after all requests finished")
    print(f"✓ 32 requests give the same tokens alone and batched, with {preemptions} preemptions and {chunks} "
          f"prefill chunks, with and without prefix caching; no block leaked")


# Every exercise of the lesson: its name -> the check, run on the implementation found in a namespace `ns`
# (the engine's modules in tests/, the learner's notebook cells in `make check`, tools/check_lessons.py).
EXERCISES = {
    "5.1 admission": lambda ns: check_scheduler(ns["Scheduler"]),
    "5.2 preemption": lambda ns: check_scheduler(ns["Scheduler"]),
    "5.3 prepare_inputs": lambda ns: check_prepare_inputs(ns["prepare_inputs"]),
}
