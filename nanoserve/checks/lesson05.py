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


def check_admission(scheduler_cls) -> None:
    """Exercise 5.1, the admission of waiting sequences (in _fill). A preemption the check makes uses the
    package's preempt (exercise 5.2's), so only the admission is checked here."""
    from nanoserve.cache.paged import PagedKVCache
    from nanoserve.cache.prefix import PrefixCachingKVCache
    from nanoserve.checks import first_difference, namespace_of, with_reference
    from nanoserve.engine.scheduler import Scheduler

    world = namespace_of(scheduler_cls)  # the scheduler's own Sequence and SequenceStatus (a notebook's, in a lesson)
    SequenceStatus = world["SequenceStatus"]  # noqa: N806
    scheduler_cls = with_reference(scheduler_cls, Scheduler, "preempt")
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
        raise AssertionError(f"(sequence, tokens) per step: {first_difference(steps, want, 'step')}, with a budget "
                             f"of 8. Running sequences come first; a waiting prompt gets what is left of the budget; "
                             f"the rest of it comes in later steps.")
    # Several waiting prompts share one budget: each admitted prompt takes its tokens out of it.
    s = scheduler_cls(PagedKVCache(config, num_blocks=64, block_size=4), max_num_seqs=4, max_num_batched_tokens=8)
    for i in range(3):
        s.add(_seq(i, 5, world=world))
    batch = s.schedule()
    got = [(q.seq_id, n) for q, n in zip(batch.seqs, batch.num_new)]
    if got != [(0, 5), (1, 3)] or [q.seq_id for q in s.waiting] != [2]:
        raise AssertionError(f"scheduled {got} with {[q.seq_id for q in s.waiting]} waiting, want [(0, 5), (1, 3)] "
                             f"with [2] waiting: three waiting 5-token prompts, a budget of 8; each admission "
                             f"spends its tokens")
    # max_num_seqs: a third sequence waits while two run.
    s = scheduler_cls(PagedKVCache(config, num_blocks=64, block_size=4), max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        s.add(_seq(i, 5, world=world))
    batch = s.schedule()
    if [q.seq_id for q in batch.seqs] != [0, 1] or [q.seq_id for q in s.waiting] != [2]:
        raise AssertionError(f"sequences {[q.seq_id for q in batch.seqs]} ran, want [0, 1], with max_num_seqs=2")
    # Without chunked prefill a prompt goes in whole or waits: prompts of 3 and 5 fill a budget of 8 exactly; of
    # 3, 6 and 2, the 6 waits, and the 2 behind it does not overtake it.
    for lengths, want in (((3, 5), [(0, 3), (1, 5)]), ((3, 6, 2), [(0, 3)])):
        s = scheduler_cls(PagedKVCache(config, num_blocks=64, block_size=4), max_num_seqs=4, max_num_batched_tokens=8,
                          enable_chunked_prefill=False)
        for i, n in enumerate(lengths):
            s.add(_seq(i, n, world=world))
        batch = s.schedule()
        got = [(q.seq_id, n) for q, n in zip(batch.seqs, batch.num_new)]
        if got != want:
            raise AssertionError(f"scheduled {got}, want {want}: chunked prefill off, budget 8, waiting prompts of "
                                 f"{lengths} tokens. A prompt that fits what is left of the budget goes in whole, "
                                 f"one that does not waits, and nobody behind it overtakes it")
    # Prefix caching: a prompt whose first blocks are cached computes only the rest, and keeps the count it found
    # when first admitted (num_cached_tokens), also when, preempted, it is recomputed from its own cached blocks.
    s = scheduler_cls(PrefixCachingKVCache(config, num_blocks=16, block_size=4), max_num_seqs=4,
                      max_num_batched_tokens=64)
    a, b = _seq(0, 9, world=world), _seq(1, 10, world=world)  # b's prompt starts with a's 9 tokens
    s.add(a)
    batch = s.schedule()
    s.cache.commit(a.seq_id, a.token_ids, a.num_computed)  # a's K/V are written: its 2 full blocks can be found
    _run(s, batch)
    s.add(b)
    batch = s.schedule()
    got = [(q.seq_id, n) for q, n in zip(batch.seqs, batch.num_new)]
    if got != [(0, 1), (1, 2)]:
        raise AssertionError(f"scheduled {got}, want [(0, 1), (1, 2)], for a 10-token prompt whose first 8 tokens "
                             f"are cached: a sequence computes what reserve did not find cached")
    if (a.num_cached_tokens, b.num_cached_tokens) != (0, 8):
        raise AssertionError(f"num_cached_tokens {b.num_cached_tokens}, want 8 ({a.num_cached_tokens} for the first "
                             f"prompt, want 0), for a 10-token prompt whose first 8 tokens are cached: a sequence "
                             f"records the count reserve found when it is first admitted")
    _run(s, batch)
    s.preempt(a)
    s.schedule()
    if a.status is not SequenceStatus.RUNNING or a.num_cached_tokens != 0:
        raise AssertionError(f"num_cached_tokens {a.num_cached_tokens}, want 0, after a preempted sequence was "
                             f"recomputed from its own cached blocks: the count of its first admission (vLLM reports "
                             f"that one)")


def check_preemption(scheduler_cls) -> None:
    """Exercise 5.2, preempt, as the scheduler calls it when blocks run out. Sequences are admitted by the
    package's _fill (exercise 5.1's admission), so only the preemption is checked here."""
    from nanoserve.cache.paged import PagedKVCache
    from nanoserve.checks import namespace_of, with_reference
    from nanoserve.engine.scheduler import Scheduler

    world = namespace_of(scheduler_cls)
    SequenceStatus = world["SequenceStatus"]  # noqa: N806
    scheduler_cls = with_reference(scheduler_cls, Scheduler, "_fill")
    # Two sequences fill the pool; when they need new blocks, the newer one is preempted.
    s = scheduler_cls(PagedKVCache(_tiny_config(), num_blocks=4, block_size=4), max_num_seqs=4,
                      max_num_batched_tokens=64)
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
    if b.status is not SequenceStatus.PREEMPTED:
        raise AssertionError(f"a preempted sequence is {b.status.name}, want PREEMPTED")
    if b.num_computed != 0:
        raise AssertionError(f"num_computed {b.num_computed} after a preemption, want 0: the sequence is recomputed "
                             f"from the start")
    if list(s.waiting) != [b, c]:
        raise AssertionError(f"sequences {[q.seq_id for q in s.waiting]} wait, want [1, 2]: a preempted sequence "
                             f"waits at the front of the queue, before the sequences that were already waiting")
    if 1 in s.cache.block_manager.block_tables:
        raise AssertionError("a preempted sequence's blocks go back to the pool")


def check_scheduler(scheduler_cls) -> None:
    """The lesson's check of its scheduler: exercise 5.1's admission, then exercise 5.2's preemption."""
    check_admission(scheduler_cls)
    check_preemption(scheduler_cls)
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


class InjectedError(Exception):
    """An error of the engine's own (a kernel that fails, say), raised by check_step on purpose."""


class InjectedInterrupt(KeyboardInterrupt):
    """Ctrl-C, raised by check_step on purpose (a subclass: a real Ctrl-C is never taken for it)."""


FAULT_NAMES = {InjectedError: "an Exception", InjectedInterrupt: "KeyboardInterrupt (Ctrl-C)"}
FAULT_PLACES = {"collect": "runner.collect", "launch": "runner.launch", "schedule": "scheduler.schedule"}


def _step_model():
    from nanoserve.checks.lesson01 import ours_from_hf
    from nanoserve.model.qwen3 import Qwen3ForCausalLM

    return ours_from_hf(Qwen3ForCausalLM, hf_tiny_model(**TINY_CONFIGS["qwen3 group=1 head_dim=64"], layers=1, seed=3))


def _step_requests():
    """Greedy and sampled requests of many lengths, one with two completions (forks, and their block copies)."""
    from nanoserve.engine.sampling_params import SamplingParams

    rng = random.Random(59)
    return [([rng.randrange(512) for _ in range(rng.randint(2, 14))],
             SamplingParams(temperature=0 if i % 3 else 0.9, seed=i, max_tokens=rng.randint(2, 10), ignore_eos=True,
                            n=2 if i == 1 else 1))
            for i in range(6)]


def _step_run(engine_cls, model, overlap: bool, fault=None, max_steps: int = 1000) -> dict:
    """Run _step_requests through engine_cls until none is left, recording for every step() call: the runner's
    launches and collects (each launched step by its number, with the step it was fed), the (seq_id, token)
    pairs returned, step_seqs, whether a step is left in flight; for a call that raised, the exception and
    the state left behind (blocks, each sequence's counts, the queues). fault: (place, exception class, n): the
    n-th call of runner.collect, runner.launch or scheduler.schedule raises. An exception the check did not
    inject ends the run (a stub's NotImplementedError passes through)."""
    from nanoserve.cache.prefix import PrefixCachingKVCache
    from nanoserve.course.step_records import record_steps

    cache = PrefixCachingKVCache(model.config, num_blocks=7, block_size=4)  # tiny: it preempts
    engine = engine_cls(model, cache, max_num_seqs=4, max_num_batched_tokens=10, async_scheduling=overlap)
    processed = record_steps(engine)
    firsts = [engine.add_request(prompt, params) for prompt, params in _step_requests()]
    seqs = [s for first in firsts for s in (first, *first.forks)]
    runner, scheduler, counts, launched, calls = engine.runner, engine.scheduler, {}, [], []

    def watch(target, name, wrap):
        original = getattr(target, name)

        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            if fault is not None and fault[0] == name and fault[2] == counts[name]:
                raise fault[1](f"raised by the check in {FAULT_PLACES[name]}")
            return wrap(original, *args, **kwargs)
        setattr(target, name, call)  # on the instance: the class keeps its own

    def number(step):
        return next((i for i, s in enumerate(launched) if s is step), None)

    def launch(original, batch, previous=None):
        step = original(batch, previous)
        launched.append(step)
        calls.append(("launch", len(launched) - 1, None if previous is None else number(previous)))
        return step

    def collect(original, step):
        calls.append(("collect", number(step)))
        return original(step)

    watch(runner, "launch", launch)
    watch(runner, "collect", collect)
    watch(scheduler, "schedule", lambda original: original())
    record, error = [], None
    while engine.has_unfinished() and len(record) < max_steps and error is None:
        calls.clear()
        entry = {}
        try:
            entry["outputs"] = [(s.seq_id, t) for s, t in engine.step()]
        except NotImplementedError:
            raise
        except (InjectedError, InjectedInterrupt) as e:
            pool = cache.block_manager
            entry["raised"] = FAULT_NAMES[type(e)]
            entry["state"] = {
                "free KV blocks": pool.num_free,
                "sequences (seq_id, status, num_computed, num_placeholders, tokens)":
                    [(s.seq_id, s.status.name, s.num_computed, s.num_placeholders, len(s.token_ids)) for s in seqs],
                "running": [s.seq_id for s in scheduler.running], "waiting": [s.seq_id for s in scheduler.waiting]}
        except Exception as e:  # the learner's step went wrong: the run stops here
            entry["raised"], error = f"{type(e).__name__}: {e}", e
        entry["calls"] = list(calls)
        entry["step_seqs"] = [s.seq_id for s in engine.step_seqs]
        entry["in flight"] = engine.in_flight is not None
        record.append(entry)
    return {"steps": record, "unfinished": engine.has_unfinished(), "stats": vars(engine.stats).copy(),
            "tokens": [s.output_ids for s in seqs], "error": error,
            "preemptions in processed steps": sum(len(r.preempted) for r in processed)}


def _say_calls(calls) -> str:
    said = [f"collect(step {c[1]})" if c[0] == "collect" else
            f"launch(step {c[1]}" + ("" if c[2] is None else f", previous=step {c[2]}") + ")" for c in calls]
    return ", ".join(said) or "nothing"


def _wrong_calls(mine: list, ref: list) -> str:
    """Why the runner calls of one step differ from the reference's."""
    my_launches, ref_launches = [c for c in mine if c[0] == "launch"], [c for c in ref if c[0] == "launch"]
    my_collects, ref_collects = [c for c in mine if c[0] == "collect"], [c for c in ref if c[0] == "collect"]
    ahead = [c for c in ref_launches if c[2] is not None]
    if ahead and not any(c[2] is not None for c in my_launches):
        if [c[:2] for c in my_launches] == [c[:2] for c in ref_launches]:
            return ("the step ahead is launched without previous=current, so its placeholders (the tokens the current "
                    "step samples) are never filled in")
        return "the next step is not launched ahead, before the current one is collected"
    if not ahead and any(c[2] is not None for c in my_launches):
        return "with async_scheduling off, each step is launched and collected alone, never one ahead"
    if [c[:2] for c in my_launches] == [c[:2] for c in ref_launches] and my_launches != ref_launches:
        return "launch the step ahead with previous=current (the step whose tokens are its placeholders)"
    if my_collects != ref_collects and my_launches == ref_launches:
        return "collect the current step (launched before), not the step launched ahead"
    return "the runner is not called as the reference calls it"


def _state_difference(mine: dict, ref: dict) -> str:
    """The first part of the state a failed step left that differs from the reference's, in words."""
    key = "sequences (seq_id, status, num_computed, num_placeholders, tokens)"
    if mine[key] != ref[key]:
        return "; ".join(f"sequence {a[0]} is {a[1]} with num_computed {a[2]}, num_placeholders {a[3]} "
                         f"(the reference's {b[1]}, {b[2]}, {b[3]})" for a, b in zip(mine[key], ref[key]) if a != b)
    return next(f"{k}: {mine[k]}, the reference {v}" for k, v in ref.items() if mine[k] != v)


def _step_difference(got: dict, want: dict, mode: str, fault) -> str | None:
    """The first thing the learner's run does differently from the reference's, said in words; or None."""
    when = "" if fault is None else f", {FAULT_PLACES[fault[0]]} raising {FAULT_NAMES[fault[1]]} on its call {fault[2]}"
    for t, (mine, ref) in enumerate(zip(got["steps"], want["steps"])):
        at = f"({mode}{when}, step() call {t + 1})"
        if mine["calls"] != ref["calls"] and not (mine.get("raised") and got["error"] is not None):
            return (f"{_wrong_calls(mine['calls'], ref['calls'])} {at}: your step called the runner's "
                    f"{_say_calls(mine['calls'])}; the reference's {_say_calls(ref['calls'])}")
        if mine.get("raised") != ref.get("raised"):
            if "raised" not in ref:
                return f"your step raised {mine['raised']} {at}; the reference's returned"
            return (f"whatever a step raises, it forgets what it launched and raises it again {at}: the reference's "
                    f"raised {ref['raised']}, yours " + (f"raised {mine['raised']}" if "raised" in mine else "returned"))
        if "raised" in ref and mine["state"] != ref["state"]:
            return (f"a failed step must take back all it counted {at}: {_state_difference(mine['state'], ref['state'])}"
                    f". On any BaseException (Ctrl-C too), forget every step launched and not processed, the current "
                    f"one and the one ahead, then raise it again")
        if "raised" in ref and mine["step_seqs"] != ref["step_seqs"]:
            return (f"engine.step_seqs must name the current step's sequences when it fails (a server fails those "
                    f"requests) {at}: yours names {mine['step_seqs']}, the reference's {ref['step_seqs']}; set it "
                    f"before collecting")
        if mine["in flight"] != ref["in flight"]:
            return (f"engine.in_flight holds the step launched ahead, and nothing else, until the next call collects "
                    f"it {at}: yours is {'a step' if mine['in flight'] else 'None'}, the reference's "
                    f"{'a step' if ref['in flight'] else 'None'}")
        if mine.get("outputs") != ref.get("outputs"):
            return (f"process the step you collected, with its tokens {at}: your step returned (seq_id, token) "
                    f"{mine.get('outputs')}, the reference's {ref.get('outputs')}")
    if got["unfinished"] or len(got["steps"]) != len(want["steps"]):
        return (f"your engine took {len(got['steps'])} step() calls{' and had not finished' if got['unfinished'] else ''}"
                f", the reference {len(want['steps'])} ({mode}{when})")
    if got["stats"] != want["stats"]:
        wrong = ", ".join(f"{k} {v}, the reference's {want['stats'][k]}" for k, v in got["stats"].items()
                          if v != want["stats"][k])
        return (f"engine.stats differ ({mode}{when}): {wrong}. steps_ahead counts the steps launched ahead; a step "
                f"ahead with no sequence to run is never processed, so step counts the preemptions its scheduling made")
    if got["tokens"] != want["tokens"]:
        return f"the requests' tokens differ from the reference's ({mode}{when})"
    return None


def check_step(engine_cls) -> None:
    """LLMEngine.step against the package's engine, call by call: the runner's launches and collects, the outputs,
    step_seqs and in_flight, with and without async scheduling; then with an Exception or a Ctrl-C injected at
    several points of collect, launch and schedule: the same exception, the same state left behind, and, as
    the engine goes on, the same tokens as a clean run."""
    import torch

    from nanoserve.engine.llm_engine import LLMEngine as Reference

    faults = [("collect", InjectedError, 1), ("collect", InjectedInterrupt, 3), ("collect", InjectedError, 9),
              ("launch", InjectedInterrupt, 2), ("launch", InjectedError, 6), ("schedule", InjectedError, 1),
              ("schedule", InjectedInterrupt, 4), ("schedule", InjectedError, 8)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small only waits for its threads (on a busy CPU, many times over)
    try:
        model = _step_model()
        for overlap in (False, True):
            mode = f"async_scheduling={overlap}"
            clean = _step_run(Reference, model, overlap)
            if overlap and not (clean["stats"]["steps_ahead"] and clean["stats"]["preemptions"]
                                > clean["preemptions in processed steps"]):
                raise RuntimeError("check_step's workload no longer preempts while scheduling an empty step ahead")
            for fault in [None, *faults]:
                want = clean if fault is None else _step_run(Reference, model, overlap, fault)
                if fault is not None and (not any("raised" in s for s in want["steps"]) or want["tokens"] != clean["tokens"]):
                    raise RuntimeError(f"check_step: the reference does not raise, or not recover from, {fault}")
                got = _step_run(engine_cls, model, overlap, fault, max_steps=2 * len(want["steps"]) + 10)
                problem = _step_difference(got, want, mode, fault)
                if problem:
                    raise AssertionError(problem) from got["error"]
    finally:
        torch.set_num_threads(threads)
    print(f"✓ step: the reference's launches, collects and outputs, one step at a time and one step ahead "
          f"({clean['stats']['steps_ahead']} of {clean['stats']['steps']} steps launched ahead); after an Exception "
          f"or a Ctrl-C in collect, launch or schedule ({len(faults)} faults), the same state, and the same tokens "
          f"as the engine goes on")

# Every exercise of the lesson: its name -> the check, run on the implementation found in a namespace `ns`
# (the engine's modules in tests/, the learner's notebook cells in `make check`, tools/check_lessons.py).
EXERCISES = {
    "5.1 admission": lambda ns: check_admission(ns["Scheduler"]),
    "5.2 preemption": lambda ns: check_preemption(ns["Scheduler"]),
    "5.3 prepare_inputs": lambda ns: check_prepare_inputs(ns["prepare_inputs"]),
    "5.4 step": lambda ns: check_step(ns["LLMEngine"]),
}
