"""vLLM's logits-editing sampling parameters: each against an oracle (transformers' logits processors
where one exists, the formula where not), on random logits, histories and batch mixes; rows that ask for nothing
stay bit for bit; and, through the engine, a request's tokens do not depend on async scheduling or batch-mates."""
import math
import random
from types import SimpleNamespace

import pytest
import torch
from transformers import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                          RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper)

from nanoserve import LLM, SamplingParams
from nanoserve.engine.features import features_of
from nanoserve.features.processors import BatchProcessors
from nanoserve.features.logit_edits import BadWords

VOCAB = 50


def seq(params, prompt, output, bad_words_ids=(), stop_ids=(), seq_id=0):
    """What the logits processors read of a sequence."""
    return SimpleNamespace(params=params, token_ids=list(prompt) + list(output), num_prompt_tokens=len(prompt),
                           prompt_ids=list(prompt), output_ids=list(output), seq_id=seq_id, finish_reason=None,
                           bad_words=BadWords([list(w) for w in bad_words_ids]) if bad_words_ids else None,
                           stop_ids=set(stop_ids), features=features_of(params), matcher=None)


def process_logits(logits, seqs, steps, last_inputs=None, processors=None):
    """The step's logits after the processors of a fresh engine (or of `processors`)."""
    processors = processors or BatchProcessors(len(seqs), logits.shape[1], "cpu")
    return processors.apply(logits, seqs, steps, last_inputs)


def history(rng, n):
    return [rng.randrange(VOCAB) for _ in range(n)]


@pytest.mark.parametrize("case", range(40))
def test_each_processor_matches_its_oracle_and_leaves_other_rows_alone(case):
    rng = random.Random(case)
    torch.manual_seed(case)
    batch = rng.randint(1, 6)
    logits = torch.randn(batch, VOCAB) * rng.choice([0.5, 3.0])
    raw = logits.clone()
    seqs, want = [], logits.clone()
    for r in range(batch):
        prompt, output = history(rng, rng.randint(1, 8)), history(rng, rng.randint(0, 8))
        kind = rng.choice(["none", "repetition", "frequency", "presence", "bias", "allowed", "bad", "min_tokens",
                           "min_p"])
        row, ids = logits[r:r + 1].clone(), torch.tensor([prompt + output])
        bad_ids, stop_ids = (), ()
        if kind == "repetition":
            p = SamplingParams(repetition_penalty=rng.choice([0.5, 1.3, 2.0]))
            row = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, row)
        elif kind in ("frequency", "presence"):
            p = SamplingParams(**{f"{kind}_penalty": rng.choice([-1.5, 0.7, 2.0])})
            counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=VOCAB).float()
            row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
        elif kind == "bias":
            bias = {rng.randrange(VOCAB): rng.uniform(-200, 200) for _ in range(3)}
            p = SamplingParams(logit_bias=bias)
            for t, b in bias.items():
                row[0, t] += max(-100, min(100, b))
        elif kind == "allowed":
            p = SamplingParams(allowed_token_ids=sorted({rng.randrange(VOCAB) for _ in range(4)}))
            masked = torch.full_like(row, -math.inf)
            masked[0, p.allowed_token_ids] = row[0, p.allowed_token_ids]
            row = masked
        elif kind == "bad":
            p = SamplingParams(bad_words=["x"])  # the ids below stand for its tokenization
            bad_ids = [[rng.randrange(VOCAB)], output[-2:] + [rng.randrange(VOCAB)] if len(output) >= 2 else [7, 8],
                       [rng.randrange(VOCAB), rng.randrange(VOCAB)]]
            # vLLM's rule: a word's last token, once the output ends with the rest of it. (transformers'
            # NoBadWordsLogitsProcessor agrees in 5.24, but not in the GPU image's 5.17: the rule is the oracle.)
            for word in bad_ids:
                if len(word) == 1 or (len(output) >= len(word) - 1 and output[len(output) - len(word) + 1:] == word[:-1]):
                    row[0, word[-1]] = -math.inf
        elif kind == "min_tokens":
            stop_ids = (3, 9)
            p = SamplingParams(min_tokens=rng.randint(0, 10))
            row = MinNewTokensLengthLogitsProcessor(len(prompt), p.min_tokens, list(stop_ids))(ids, row)
        elif kind == "min_p":
            p = SamplingParams(min_p=rng.choice([0.05, 0.3, 0.9]), temperature=rng.choice([0.5, 1.0, 1.7]))
            # transformers' order: temperature, then min_p over the scaled scores; masked tokens are -inf
            scaled = TemperatureLogitsWarper(p.temperature)(ids, row.clone())
            kept = MinPLogitsWarper(p.min_p)(ids, scaled) > -math.inf
            row = row.masked_fill(~kept, -math.inf)
        else:
            p = SamplingParams()
        seqs.append(seq(p, prompt, output, bad_ids, stop_ids, seq_id=r))
        want[r] = row[0]
    got = process_logits(logits, seqs, [len(s.token_ids) - s.num_prompt_tokens for s in seqs])
    assert torch.equal(logits, raw)  # the input is left as it was (its log-probs are what logprobs report)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    assert torch.allclose(got[finite], want[finite], atol=1e-5)
    for r, s in enumerate(seqs):
        if not s.features:
            assert torch.equal(got[r], raw[r])


def test_a_token_still_on_the_device_counts_for_the_penalties():
    """Async scheduling: the last drawn token is a placeholder, known only as the row's last input."""
    logits = torch.zeros(2, VOCAB)
    p = SamplingParams(frequency_penalty=1.0)
    seqs = [seq(p, [1], [4, 4], seq_id=0), seq(p, [1], [4, 4], seq_id=1)]
    got = process_logits(logits, seqs, [3, 2], last_inputs=lambda: torch.tensor([4, 0]))
    assert got[0, 4] == -3 and got[1, 4] == -2  # row 0 has drawn three 4s, one not on the host yet


@pytest.mark.parametrize("case", range(10))
def test_penalty_counts_kept_on_the_device_match_a_recount_every_step(case):
    """One engine's processors over many steps, tokens drawn on the device, rows joining, leaving and moving,
    and now and then a step whose draw is never processed (an error, Ctrl-C): every step's logits are what
    processors that count each output afresh give."""
    rng = random.Random(case)
    kept = BatchProcessors(8, VOCAB, "cpu")
    live = {}
    for step in range(30):
        for seq_id in [i for i in live if rng.random() < 0.1]:
            live.pop(seq_id).finish_reason = "stop"
        while len(live) < rng.randint(1, 8):
            seq_id = step * 10 + len(live)
            p = SamplingParams(repetition_penalty=rng.choice([1.0, 1.5]), frequency_penalty=rng.uniform(-2, 2),
                               presence_penalty=rng.uniform(-2, 2))
            live[seq_id] = seq(p, history(rng, rng.randint(1, 5)), history(rng, rng.randint(0, 3)), seq_id=seq_id)
        if step and rng.random() < 0.5:  # the last rows still running, then new ones (as decoding goes)
            running = [s for s in seqs if s.finish_reason is None]
            seqs = running + [s for s in live.values() if all(s is not r for r in running)]
        else:
            seqs = rng.sample(list(live.values()), len(live))  # rows move
        steps = [len(s.output_ids) for s in seqs]
        logits = torch.randn(len(seqs), VOCAB)
        got = process_logits(logits, seqs, steps, processors=kept)
        assert torch.allclose(got, process_logits(logits, seqs, steps), atol=1e-6), step
        tokens = torch.tensor([rng.randrange(VOCAB) for _ in seqs])
        kept.drawn(tokens)
        if rng.random() < 0.8:  # processed; else the drawn tokens are lost, as a failed step's are
            for s, t in zip(seqs, tokens.tolist()):
                s.token_ids.append(t)
                s.output_ids.append(t)


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-qwen3", device="cpu", max_model_len=256, num_gpu_blocks_override=128) as llm:  # (the GPU: tests/gpu/test_gpu_features.py)
        yield llm


EDITING = [dict(repetition_penalty=1.8), dict(frequency_penalty=2.0, temperature=1.0), dict(presence_penalty=-1.0, temperature=0.9),
           dict(min_p=0.2, temperature=1.2), dict(logit_bias={17: 100.0}, temperature=0.8), dict(min_tokens=5),
           dict(allowed_token_ids=[11, 12, 13], temperature=1.0), dict(bad_words=["hello world", "the"])]


def run(engine, prompts, params):
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
    return [s.output_ids for s in seqs]


def test_penalised_requests_are_the_same_alone_in_a_batch_and_scheduled_ahead(llm):
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 1000) for _ in range(rng.randint(2, 12))] for _ in EDITING]
    params = [SamplingParams(max_tokens=14, ignore_eos=True, seed=i, **kw) for i, kw in enumerate(EDITING)]
    engine = llm.engine
    alone = [run(engine, [p], [sp])[0] for p, sp in zip(prompts, params)]
    together = run(engine, prompts, params)
    engine.async_scheduling = True  # the CPU's eager engine, scheduling one step ahead (placeholders)
    try:
        ahead = run(engine, prompts, params)
        assert engine.stats.steps_ahead > 0
    finally:
        engine.async_scheduling = False
    assert together == alone and ahead == alone
    plain = run(engine, prompts, [SamplingParams(max_tokens=14, ignore_eos=True, seed=i) for i in range(len(EDITING))])
    # the parameters changed their requests' tokens (min_tokens has no stop token to hold off here, these bad
    # words do not come up, and the random model's logits are too peaked for a frequency penalty of 2 to
    # matter: the oracle test above checks those formulas)
    changed = [a != b for kw, a, b in zip(EDITING, alone, plain)]
    assert all(c for kw, c in zip(EDITING, changed) if not {"min_tokens", "bad_words", "frequency_penalty"} & set(kw))
    assert all(t in (11, 12, 13) for t in alone[6]) and alone[4].count(17) == 14


@pytest.mark.parametrize("ahead", [False, True])
def test_bad_words_are_never_generated_even_when_the_model_prefers_them(llm, ahead):
    """A word of two tokens: its second is masked only right after its first, which async scheduling must
    have seen on the host (such a request sits out the steps where its last token is a placeholder)."""
    tok = llm.tokenizer
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    free = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    for start in range(len(free) - 1):  # a pair that tokenizes back to itself, so the ban can bite
        word = tok.decode(free[start:start + 2])
        if tok.encode(word, add_special_tokens=False) == free[start:start + 2] and word.strip():
            break
    else:
        pytest.skip("no two-token word in the greedy output that tokenizes back to itself")
    llm.engine.async_scheduling = ahead
    try:
        out = llm.generate([[5, 6, 7]], greedy.clone(bad_words=[word]), use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.engine.async_scheduling = False
    pair = free[start:start + 2]
    assert out[:start + 1] == free[:start + 1]  # up to the word's first token, nothing changed
    assert not any(out[i:i + 2] == pair for i in range(len(out) - 1))


def test_min_tokens_holds_off_the_stop_token_and_max_tokens_none_fills_the_context(llm):
    eos = sorted(llm.eos_token_ids)[0]
    sp = SamplingParams(temperature=0, max_tokens=20, min_tokens=6, logit_bias={eos: 100.0})
    out = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[-1] == eos and len(out.token_ids) == 7 and out.finish_reason == "stop"
    long = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True,
                                                    truncate_prompt_tokens=2), use_tqdm=False)[0]
    assert long.prompt_token_ids == [6, 7] and len(long.outputs[0].token_ids) == 256 - 2


def test_include_stop_str_and_skip_special_tokens(llm):
    tok = llm.tokenizer
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    text = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].text
    stop = text[3:5]
    cut = llm.generate([[5, 6, 7]], greedy.clone(stop=[stop]), use_tqdm=False)[0].outputs[0].text
    kept = llm.generate([[5, 6, 7]], greedy.clone(stop=[stop], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0].text
    assert kept == cut + stop and text.startswith(kept)
    special = tok.all_special_ids[0]
    forced = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={special: 100.0})
    skipped, shown = (llm.generate([[5]], forced.clone(skip_special_tokens=s), use_tqdm=False)[0].outputs[0].text
                      for s in (True, False))
    assert skipped == "" and shown == tok.decode([special] * 3, skip_special_tokens=False)


@pytest.mark.parametrize("bad", [dict(presence_penalty=3), dict(repetition_penalty=0), dict(min_p=1.5),
                                 dict(min_tokens=20, max_tokens=10), dict(logit_bias={"a": 1}),
                                 dict(allowed_token_ids=[]), dict(bad_words=[""]), dict(truncate_prompt_tokens=0),
                                 dict(skip_special_tokens="yes")])
def test_bad_values_are_refused_by_name(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_stop_reason_and_num_cached_tokens(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    free = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0]
    by_token = llm.generate([[5, 6, 7]], greedy.clone(stop_token_ids=[free.token_ids[3]]), use_tqdm=False)[0]
    assert by_token.outputs[0].stop_reason == free.token_ids[3] and by_token.outputs[0].finish_reason == "stop"
    stop = free.text[4:6]
    by_text = llm.generate([[5, 6, 7]], greedy.clone(stop=["\x00never", stop]), use_tqdm=False)[0].outputs[0]
    assert by_text.stop_reason == stop and free.stop_reason is None
    prompt = list(range(100, 100 + 40))  # 40 tokens: two full blocks of 16 to find again
    first = llm.generate([prompt], greedy, use_tqdm=False)[0]
    again = llm.generate([prompt + [1, 2]], greedy.clone(n=2, seed=1), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32


def test_a_logits_processor_of_your_own_edits_only_the_requests_that_want_it():
    """vLLM's logits_processors argument: a LogitsProcessor class with per-slot state on the device."""
    from nanoserve.features.processors import LogitsProcessor

    class ForceToken(LogitsProcessor):
        """Requests whose extra_args hold {"ForceToken": t} draw t, every time."""

        def __init__(self, *args):
            super().__init__(*args)
            self.token = torch.zeros(self.max_rows, dtype=torch.long, device=self.device)

        def add(self, slot, seq):
            self.token[slot] = seq.params.extra_args["ForceToken"]

        def apply(self, logits, rows):
            forced = self.token[rows.slots]
            keep = logits[rows.index, forced]
            logits[rows.index] = float("-inf")
            logits[rows.index, forced] = keep

    prompts = ["one", "two", "three"]
    params = [SamplingParams(max_tokens=5, seed=i, extra_args={"ForceToken": 40 + i} if i != 1 else None)
              for i in range(3)]
    with LLM("tiny-qwen3", device="cpu", max_model_len=64, num_gpu_blocks_override=32,
             logits_processors=[ForceToken]) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    with LLM("tiny-qwen3", device="cpu", max_model_len=64, num_gpu_blocks_override=32) as plain:
        alone = plain.generate(prompts[1], params[1], use_tqdm=False)[0]
    assert outs[0].outputs[0].token_ids == [40] * 5 and outs[2].outputs[0].token_ids == [42] * 5
    assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids != [41] * 5
    with pytest.raises(ValueError, match="logits_processors"):
        LLM("tiny-qwen3", device="cpu", logits_processors=[object])


@pytest.mark.parametrize("case", range(4))
def test_min_p_follows_each_rows_slot_when_rows_move(case):
    """min_p's floors live per slot: with every row of a step asking (edited in place) or only some, and the
    rows in another order each step, each row gets its own floor, as processors made afresh give it."""
    rng = random.Random(case)
    kept = BatchProcessors(6, VOCAB, "cpu")
    live = [seq(SamplingParams(min_p=rng.choice([0.02, 0.3, 0.8]), temperature=rng.choice([0.5, 1.0, 2.0])),
                history(rng, 3), [], seq_id=i) for i in range(5)]
    plain = seq(SamplingParams(), history(rng, 3), [], seq_id=99)
    for step in range(6):
        seqs = rng.sample(live, len(live)) + ([plain] if step % 2 else [])  # every row asks, or all but one
        logits = torch.randn(len(seqs), VOCAB) * 3
        got = process_logits(logits, seqs, [0] * len(seqs), processors=kept)
        assert torch.equal(got, process_logits(logits, seqs, [0] * len(seqs))), step


@pytest.mark.parametrize("case", range(6))
def test_every_processors_rows_and_slots_start_on_16_bytes(case):
    """A step's layout gives each processor its rows and their slots as slices of one tensor. Triton compiles
    a kernel for the alignment of its pointers, so a slice at an odd offset (an odd number of rows before it)
    would compile every processor's kernel again in the middle of a run: each slice starts on 16 bytes, and
    holds exactly its rows and slots."""
    rng = random.Random(case)
    kept = BatchProcessors(40, VOCAB, "cpu")
    asks = [dict(min_p=0.1), dict(logit_bias={1: 2.0}), dict(repetition_penalty=1.2), dict(allowed_token_ids=[3]),
            dict(min_tokens=2)]
    seqs = [seq(SamplingParams(**{k: v for f in rng.sample(asks, rng.randint(0, 3)) for k, v in f.items()}),
                history(rng, 3), [], stop_ids=[0], seq_id=i) for i in range(rng.randint(3, 40))]
    layout = kept.layout(seqs)
    assert layout and sum(len(rows) for _, rows, *_ in layout) == sum(len(s.features) for s in seqs)
    for processor, rows, index, slots, slot_ids, row_seqs in layout:
        assert index.data_ptr() % 16 == 0 and slots.data_ptr() % 16 == 0, (type(processor).__name__, len(rows))
        assert index.tolist() == rows and slots.tolist() == slot_ids == [kept.slot(seqs[i]) for i in rows]
        assert row_seqs == [seqs[i] for i in rows]


def test_a_burst_of_joining_requests_is_written_in_as_many_copies_as_one():
    """The processors keep their rows' state on the device: a request's state is written when it first joins a
    step. 64 requests joining one step are written in one copy per table, as one is: 64 times as many small
    copies (a launch each on a GPU) made one step of a burst of requests stall the batch."""
    import nanoserve.features.logit_edits as logit_edits
    import nanoserve.features.penalties as penalties
    import nanoserve.features.processors as processors

    def copies(n):
        params = SamplingParams(temperature=0.7, min_p=0.1, logit_bias={3: 2.0, 7: -1.0}, repetition_penalty=1.3,
                                presence_penalty=0.5)
        rng, made = random.Random(n), []
        seqs = [seq(params, history(rng, 5), history(rng, 3), seq_id=i) for i in range(n)]
        original = processors.to_device

        def counted(*args):
            made.append(args[0])
            return original(*args)
        for module in (processors, logit_edits, penalties):
            module.to_device = counted
        try:
            process_logits(torch.randn(n, VOCAB), seqs, [3] * n)
        finally:
            for module in (processors, logit_edits, penalties):
                module.to_device = original
        return len(made)
    assert copies(64) == copies(1)


@pytest.mark.parametrize("case", range(6))
def test_a_step_that_only_bans_edits_the_models_own_logits_as_float32_would(case):
    """min_p, allowed_token_ids, bad_words and min_tokens only write -inf, which bfloat16 holds exactly: where
    every processor of a step only bans, the model's bfloat16 logits are edited themselves (no float32 copy),
    and they are the float32 path's, rounded; a logit_bias in the step brings the float32 copy back."""
    rng = random.Random(case)
    torch.manual_seed(case)
    kinds = [dict(min_p=0.2, temperature=0.7), dict(allowed_token_ids=rng.sample(range(VOCAB), 9)),
             dict(bad_words=["x"], min_tokens=4), dict(min_p=0.05, temperature=1.3, min_tokens=2)]
    seqs = [seq(SamplingParams(**rng.choice(kinds)), history(rng, 4), history(rng, 2), bad_words_ids=[[5], [6, 7]],
                stop_ids=[3], seq_id=i) for i in range(rng.randint(1, 6))]
    logits = (torch.randn(len(seqs), VOCAB) * 4).bfloat16()
    want = process_logits(logits.float(), seqs, [2] * len(seqs))
    edited = logits.clone()
    got = BatchProcessors(len(seqs), VOCAB, "cpu").apply(edited, seqs, [2] * len(seqs), in_place=True)
    assert got is edited and got.dtype == torch.bfloat16 and torch.equal(got.float(), want)
    assert (want == float("-inf")).any()
    biased = seqs + [seq(SamplingParams(logit_bias={1: 0.3}), [1], [], seq_id=len(seqs))]
    logits = torch.cat([logits, logits[:1]])
    got = BatchProcessors(len(biased), VOCAB, "cpu").apply(logits, biased, [2] * len(biased), in_place=True)
    assert got.dtype == torch.float32 and logits.dtype == torch.bfloat16
