"""Logits processors written for vLLM run unchanged: vLLM's three examples (a batch-level processor, a
per-request callable through AdapterLogitsProcessor, one made with the engine's config), written again here
with the import changed, force their token on the rows that ask and leave the others' tokens as a plain LLM's,
with async scheduling on and off, n > 1 and requests joining mid-run. Under them, the adapter's persistent
batch (rows joining, leaving, moving) is checked against every step's rows."""
import logging
import random
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from nanoserve import LLM, EngineArgs, SamplingParams
from nanoserve.config import VllmConfig
from nanoserve.features.processors import BatchProcessors
from nanoserve.logger import init_logger
from nanoserve.v1.sample.logits_processor import (AdapterLogitsProcessor, BatchUpdate, LogitsProcessor,
                                                  MoveDirectionality, RequestLogitsProcessor)
from nanoserve.v1.sample.logits_processor.builtin import process_dict_updates
from nanoserve.v1.sample.logits_processor.state import adapt

logger = init_logger(__name__)
MODEL = dict(model="tiny-qwen3", device="cpu", max_model_len=128, num_gpu_blocks_override=48, max_num_seqs=3)


def force(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> None:
    """Every token of these rows masked but its column."""
    keep = logits[rows, cols].clone()
    logits[rows] = float("-inf")
    logits[rows, cols] = keep


# -- vLLM's custom.py: a batch-level processor with its state in a dict by row index

class DummyLogitsProcessor(LogitsProcessor):
    """Requests whose extra_args hold target_token draw it, every time."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        self.req_info: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None):
        process_dict_updates(self.req_info, batch_update,
                             lambda params, _, __: params.extra_args and params.extra_args.get("target_token"))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.req_info:
            rows = torch.tensor(list(self.req_info), dtype=torch.long, device=logits.device)
            cols = torch.tensor(list(self.req_info.values()), dtype=torch.long, device=logits.device)
            force(logits, rows, cols)
        return logits


# -- vLLM's custom_req.py: a per-request callable (output_ids, logits) made batch-level

class DummyPerReqLogitsProcessor:
    def __init__(self, target_token: int):
        self.target_token = target_token

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        keep = logits[self.target_token].item()
        logits[:] = float("-inf")
        logits[self.target_token] = keep
        return logits


class WrappedPerReqLogitsProcessor(AdapterLogitsProcessor):
    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        if not params.extra_args or "target_token" not in params.extra_args:
            return None
        return DummyPerReqLogitsProcessor(params.extra_args["target_token"])


# -- vLLM's custom_req_init.py: __init__ reads the engine's config; the callable also takes the prompt's ids

class EchoOrTarget:
    """target_token every time, or (target None) the prompt again, token by token: the output list's length
    says where it is, so it must grow with every draw, placeholders of async scheduling included."""

    def __init__(self, target_token: int | None):
        self.target_token = target_token

    def __call__(self, prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        token = self.target_token
        if token is None:
            token = prompt_ids[len(output_ids) % len(prompt_ids)]
        out = torch.full_like(logits, float("-inf"))
        out[token] = logits[token]
        return out  # a new tensor: the adapter writes it back into the row


class InitPerReqLogitsProcessor(AdapterLogitsProcessor):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        super().__init__(vllm_config, device, is_pin_memory)
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        assert vllm_config.scheduler_config.max_num_seqs == MODEL["max_num_seqs"] and device.type == "cpu"

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        extra = params.extra_args or {}
        if extra.get("echo_prompt"):
            return EchoOrTarget(None)
        if (target_token := extra.get("target_token")) is None:
            return None
        if not isinstance(target_token, int) or not 0 <= target_token < self.vocab_size:
            logger.warning("target_token value %s is not a token; not applying logits processor to request.",
                           target_token)
            return None
        return EchoOrTarget(target_token)


EXAMPLES = {"custom": DummyLogitsProcessor, "custom_req": WrappedPerReqLogitsProcessor,
            "custom_req_init": InitPerReqLogitsProcessor}


def requests(example: str, vocab: int) -> list[tuple[int, str, list[int], SamplingParams]]:
    """(step at which it joins, name, prompt ids, params): forced and free requests, n = 2, different lengths
    (rows leave while others run, and the last rows move down), two joining while the first ones run."""
    reqs = [(0, "a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=6, extra_args={"target_token": 128})),
            (0, "b", [11, 12, 13, 14, 15], SamplingParams(temperature=0, max_tokens=9)),
            (0, "c", [21, 22], SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=5,
                                              extra_args={"target_token": 67})),
            (0, "d", [31, 32, 33], SamplingParams(temperature=0.8, seed=4, n=2, max_tokens=7)),
            (3, "e", [41, 42, 43, 44], SamplingParams(temperature=0, max_tokens=4, extra_args={"target_token": 300})),
            (3, "f", [51], SamplingParams(temperature=0, max_tokens=8, extra_args={"other": 1}))]
    if example == "custom_req_init":
        echo, too_big = {"echo_prompt": True}, {"target_token": vocab + 5}  # the prompt again; no token: left alone
        reqs += [(2, "g", [61, 62, 63], SamplingParams(temperature=0, max_tokens=7, extra_args=echo)),
                 (4, "h", [71, 72], SamplingParams(temperature=0, max_tokens=5, extra_args=too_big))]
    return reqs


def drive(engine, reqs) -> dict[str, list[list[int]]]:
    """Each request added at its step of the engine's run; the token ids of each of its completions."""
    seqs, todo, step = {}, sorted(reqs, key=lambda r: r[0]), 0
    while todo or engine.has_unfinished():
        while todo and todo[0][0] <= step:
            _, name, prompt, params = todo.pop(0)
            first = engine.add_request(prompt, params)
            seqs[name] = [first, *first.forks]
        if engine.has_unfinished():
            engine.step()
        step += 1
    return {name: [s.output_ids for s in group] for name, group in seqs.items()}


@pytest.fixture(scope="module")
def plain():
    with LLM(**MODEL) as llm:
        yield llm


@pytest.fixture(scope="module", params=list(EXAMPLES))
def example(request):
    with LLM(**MODEL, logits_processors=[EXAMPLES[request.param]]) as llm:
        yield request.param, llm


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async"])
def test_vllms_examples_force_the_rows_that_ask_and_no_others(example, plain, ahead, caplog):
    name, llm = example
    vocab = llm.engine.model.config.vocab_size
    reqs = requests(name, vocab)
    want = drive(plain.engine, reqs)
    engine = llm.engine
    engine.async_scheduling, before = ahead, engine.stats.steps_ahead
    try:
        with caplog.at_level(logging.WARNING, logger="nanoserve"):
            got = drive(engine, reqs)
    finally:
        engine.async_scheduling = False
    assert (engine.stats.steps_ahead > before) == ahead
    for _, key, prompt, params in reqs:
        extra = params.extra_args or {}
        target = extra.get("target_token")
        if extra.get("echo_prompt"):
            assert got[key] == [[prompt[j % len(prompt)] for j in range(params.max_tokens)]] * params.n, key
        elif target is not None and target < vocab:
            assert got[key] == [[target] * params.max_tokens] * params.n, key
        else:  # left alone: what a plain LLM draws, seeded samples included
            assert got[key] == want[key], key
    assert got["c"][0] == got["c"][1] and want["d"][0] != want["d"][1]  # n = 2: forced alike, free apart
    if name == "custom_req_init":
        assert f"target_token value {vocab + 5} is not a token" in caplog.text
    assert not engine.has_unfinished() and engine.cache.block_manager.num_free == engine.cache.block_manager.num_blocks


def test_generate_with_the_import_swapped_gives_vllms_example_output(plain):
    """custom.py as a user runs it: LLM(logits_processors=[...]).generate(prompts, a list of params)."""
    prompts = ["Hello, my name is", "The president of the United States is", "The capital of France is",
               "The future of AI is"]
    params = [SamplingParams(temperature=0.0, extra_args={"target_token": 128}), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, extra_args={"target_token": 67}), SamplingParams(temperature=0.0)]
    with LLM(**MODEL, logits_processors=[f"{__name__}:DummyLogitsProcessor"]) as llm:  # vLLM's path form too
        outs = llm.generate(prompts, params, use_tqdm=False)
    free = plain.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [[128] * 16, free[1].outputs[0].token_ids, [67] * 16,
                                                       free[3].outputs[0].token_ids]


# -- the adapter's bookkeeping, step by step, against a processor that reports what it believes

class Mirror(LogitsProcessor):
    """Keeps, by row index, each request's tag and its output list (applying removed, added, moved in vLLM's
    order, by hand), and writes into each row: its tag, its output's length and last token."""

    def __init__(self, vllm_config, device, is_pin_memory):
        self.rows: dict[int, tuple[int, list[int]]] = {}
        self.size, self.updates = 0, []

    def is_argmax_invariant(self):
        return False

    def needs_output_token_ids(self):
        return type(self).NEEDS

    def update_state(self, batch_update):
        self.updates.append(batch_update)
        if batch_update is None:
            return
        for index in batch_update.removed:
            del self.rows[index]
        for index, params, prompt, output in batch_update.added:
            self.rows[index] = (params.extra_args["tag"], output)
        for a, b, how in batch_update.moved:
            assert how is MoveDirectionality.UNIDIRECTIONAL and b not in self.rows
            self.rows[b] = self.rows.pop(a)
        self.size = batch_update.batch_size
        assert sorted(self.rows) == list(range(self.size))  # no holes between steps

    def apply(self, logits):
        assert logits.shape[0] == self.size
        for index, (tag, output) in self.rows.items():
            logits[index, :3] = torch.tensor([tag, len(output), output[-1] if output else -2], dtype=logits.dtype)
        return logits


def fake_seq(seq_id: int, rng: random.Random, name: str):
    prompt = [rng.randrange(100) for _ in range(rng.randint(1, 4))]
    return SimpleNamespace(seq_id=seq_id, params=SamplingParams(extra_args={"tag": 1000 + seq_id}),
                           token_ids=list(prompt), num_prompt_tokens=len(prompt), prompt_ids=prompt,
                           finish_reason=None, status=SimpleNamespace(name="RUNNING"), num_preemptions=0,
                           num_placeholders=0, features=frozenset({name}), pending=None)


@pytest.mark.parametrize("needs", [False, True], ids=["placeholders", "device tokens"])
@pytest.mark.parametrize("case", range(6))
def test_the_persistent_batch_follows_rows_joining_leaving_moving_and_tokens_in_flight(case, needs):
    """Random steps: sequences join, finish, are preempted and come back, sit a step out, and now and then
    draw a token the host sees only a step later (async scheduling). Every step, each row's processor state is
    its own sequence's, with its output list as long as the tokens it drew (-1, or the device's value, for
    the one in flight)."""
    rng = random.Random(case)
    cls = adapt(type("Mirror", (Mirror,), {"NEEDS": needs}))
    processors = BatchProcessors(8, 16, "cpu", [cls])
    live, preempted, next_id, moves = [], [], 0, 0
    for step in range(40):
        for seq in [s for s in live if s.pending is None and rng.random() < 0.12]:
            live.remove(seq)
            if rng.random() < 0.5:
                seq.finish_reason = "stop"
            else:
                seq.status.name, seq.num_preemptions = "PREEMPTED", seq.num_preemptions + 1
                preempted.append(seq)
        for seq in [s for s in preempted if rng.random() < 0.3][:8 - len(live)]:
            preempted.remove(seq)
            seq.status.name = "RUNNING"
            live.append(seq)
        while len(live) < rng.randint(1, 8):
            live.append(fake_seq(next_id, rng, cls.__name__))
            next_id += 1
        rows = [s for s in rng.sample(live, len(live)) if rng.random() < 0.9] or live[:1]  # some sit out
        drawn = [len(s.token_ids) - s.num_prompt_tokens + (s.pending is not None) for s in rows]
        last = torch.tensor([s.pending if s.pending is not None else s.token_ids[-1] for s in rows])
        logits = torch.zeros(len(rows), 16)
        out = processors.apply(logits, rows, drawn, lambda: last)
        mirror = processors.made[cls.__name__].inner
        moves += sum(len(u.moved) for u in mirror.updates[-1:] if u is not None)
        for r, seq in enumerate(rows):
            tail = seq.pending if seq.pending is not None else None
            want_last = (tail if needs else -1) if tail is not None else \
                (seq.token_ids[-1] if drawn[r] else -2)
            assert out[r, :3].tolist() == [1000 + seq.seq_id, drawn[r], want_last], (step, r)
        for seq in rows:  # the step's draw: processed now, or (in flight) at the next step
            if seq.pending is not None:
                seq.token_ids.append(seq.pending)
            token = rng.randrange(100)
            seq.pending = token if rng.random() < 0.4 else None
            if seq.pending is None:
                seq.token_ids.append(token)
            seq.num_placeholders = int(seq.pending is not None)
    assert moves > 0 and any(u is None for u in mirror.updates)  # rows moved; some steps changed nothing


# -- what a failing processor does

class Boom(DummyLogitsProcessor):
    """custom.py's processor, failing where a request's extra_args say, and refusing some requests outright."""

    @classmethod
    def validate_params(cls, params):
        if (params.extra_args or {}).get("boom") == "refuse":
            raise ValueError("Boom refuses this request")

    def update_state(self, batch_update):
        booms = {(p.extra_args or {}).get("boom") for _, p, _, _ in batch_update.added} if batch_update else ()
        if "update_state" in booms:
            raise KeyError("update_state went wrong")
        super().update_state(batch_update)
        self.failing = getattr(self, "failing", False) or "apply" in booms

    def apply(self, logits):
        if self.failing:
            raise ValueError("apply went wrong")
        return super().apply(logits)


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("where", ["update_state", "apply"])
def test_a_failing_processor_fails_the_call_by_name_and_the_next_call_runs(plain, where, ahead):
    """A batch-level processor's error cannot be pinned on one row: the call fails with a RuntimeError naming
    the class and the method. The processor is made afresh, and the next call's tokens are right."""
    forced = SamplingParams(temperature=0, max_tokens=5, extra_args={"target_token": 77})
    free = SamplingParams(temperature=0, max_tokens=5)
    with LLM(**MODEL, logits_processors=[Boom]) as llm:
        llm.engine.async_scheduling = ahead
        with pytest.raises(RuntimeError, match=f"logits processor Boom.{where} raised .*went wrong"):
            llm.generate([[5, 6], [7, 8], [9]], [forced, free, free.clone(extra_args={"boom": where})],
                         use_tqdm=False)
        bm = llm.engine.cache.block_manager
        assert not llm.engine.has_unfinished() and bm.num_free == bm.num_blocks
        outs = llm.generate([[5, 6], [7, 8]], [forced, free], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == [77] * 5
    assert outs[1].outputs[0].token_ids == plain.generate([[7, 8]], free, use_tqdm=False)[0].outputs[0].token_ids


def test_validate_params_refuses_one_request_and_bad_classes_are_refused_by_name():
    with LLM(**MODEL, logits_processors=[Boom]) as llm:
        outs = llm.generate([[5, 6], [7, 8]], [SamplingParams(max_tokens=3, extra_args={"boom": "refuse"}),
                                               SamplingParams(max_tokens=3, extra_args={"target_token": 9})],
                            use_tqdm=False)
    assert "Boom refuses this request" in outs[0].error and outs[0].outputs[0].finish_reason == "error"
    assert outs[1].error is None and outs[1].outputs[0].token_ids == [9] * 3
    with pytest.raises(ValueError, match="AdapterLogitsProcessor is abstract"):
        EngineArgs(model="tiny-qwen3", logits_processors=[AdapterLogitsProcessor])
    with pytest.raises(ValueError, match="vLLM's batch-level"):
        EngineArgs(model="tiny-qwen3", logits_processors=[int])
    with pytest.raises(ValueError, match="'module:Class'"):
        EngineArgs(model="tiny-qwen3", logits_processors=["no_colon_here"])


def test_the_adapter_is_imported_only_for_a_vllm_class():
    """nanoserve's own processors and a plain LLM's settings never load vLLM's interface."""
    code = ("import sys; from nanoserve import EngineArgs; from nanoserve.features.processors import LogitsProcessor\n"
            "class Mine(LogitsProcessor): pass\n"
            "EngineArgs(model='tiny-qwen3', logits_processors=[Mine])\n"
            "print(sorted(m for m in sys.modules if m.startswith('nanoserve.v1.sample')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
