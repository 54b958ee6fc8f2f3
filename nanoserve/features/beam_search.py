"""Beam search, as vLLM's LLM.beam_search does it, beside the engine: no step of the engine knows of it.

Each round asks the engine for one token of every live beam, with the 2 x beam_width likeliest next tokens'
log-probabilities (SamplingParams(max_tokens=1, logprobs=...)); every beam grows by each of them, and each
prompt keeps its beam_width best candidates by score: the summed log-probability over the length (prompt
included, a final end-of-text not counted) to the power length_penalty. A candidate that ends with the
end-of-text token is complete and stops growing (unless ignore_eos). The prefix cache (lesson 04) holds
every beam's tokens, so a round computes only its one new token per beam."""
from dataclasses import dataclass, field

from nanoserve.engine.sampling_params import SamplingParams


@dataclass
class BeamSearchParams:
    """vLLM's (vllm.sampling_params.BeamSearchParams)."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # the draw each round makes; the beams follow the log-probabilities
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # a completed beam's text ends with the end-of-text token's

    def __post_init__(self):
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")


@dataclass
class BeamSearchSequence:
    """One beam: its tokens (the prompt's first), one {token: Logprob} per new token, their summed
    log-probability, and its text (the whole of it, prompt included, as vLLM's)."""
    tokens: list[int]
    logprobs: list[dict] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop": it ended with the end-of-text token; "length"
    stop_reason: int | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # the best first


def beam_score(beam: BeamSearchSequence, eos: int | None, length_penalty: float) -> float:
    length = len(beam.tokens) - (beam.tokens[-1] == eos)
    return beam.cum_logprob / max(length, 1) ** length_penalty


def beam_search(llm, prompts, params: BeamSearchParams, use_tqdm: bool = False,
                concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
    """For each prompt, its params.beam_width best beams, the text of each its whole text. concurrency_limit:
    at most that many prompts' beams in the engine at once (all of them by default)."""
    check_width(params, llm.max_logprobs)
    encoded, out = llm._encode(prompts), []
    step = max(1, concurrency_limit or len(encoded))
    one_token = round_params(params)
    for start in range(0, len(encoded), step):
        search = rounds([ids for _, ids in encoded[start:start + step]], params, llm.tokenizer.eos_token_id)
        asked = next(search)
        try:
            while True:
                outputs = llm.generate([{"prompt_token_ids": tokens} for tokens in asked], one_token,
                                       use_tqdm=use_tqdm)
                failed = [o.error for o in outputs if o.error]
                if failed:
                    raise RuntimeError(f"beam search: {failed[0]}")
                asked = search.send([o.outputs[0].logprobs[0] for o in outputs])
        except StopIteration as done:
            for beams in done.value:
                for beam in beams:
                    beam.text = llm.tokenizer.decode(beam_tokens(beam, 0, params))
                out.append(BeamSearchOutput(beams))
    return out


def check_width(params: BeamSearchParams, max_logprobs: int) -> None:
    if 2 * params.beam_width > max_logprobs:
        raise ValueError(f"beam_width {params.beam_width} asks for {2 * params.beam_width} log-probs a token, "
                         f"over max_logprobs {max_logprobs} (LLM(max_logprobs=...) raises the limit)")


def round_params(params: BeamSearchParams) -> SamplingParams:
    """What the engine is asked each round, for each beam: one token, and the likeliest next tokens."""
    return SamplingParams(max_tokens=1, logprobs=2 * params.beam_width, temperature=params.temperature,
                          detokenize=False)


def beam_tokens(beam: BeamSearchSequence, start: int, params: BeamSearchParams) -> list[int]:
    """The beam's tokens from `start` on, for its text: a final end-of-text token only if
    include_stop_str_in_output."""
    end = len(beam.tokens) - (beam.finish_reason == "stop" and not params.include_stop_str_in_output)
    return beam.tokens[start:end]


def rounds(prompts: list[list[int]], params: BeamSearchParams, eos: int | None):
    """The search, apart from how the engine is asked (LLM.generate here, the server's engine in lesson 08): a
    generator that yields each round's beams (token lists) and is sent, for each, its next token's
    {token: log-probability} candidates; it returns each prompt's best beams, the best first."""
    width, score = params.beam_width, lambda beam: beam_score(beam, eos, params.length_penalty)
    live = [[BeamSearchSequence(list(ids))] for ids in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        beams = [(p, beam) for p, beams in enumerate(live) for beam in beams]
        if not beams:
            break
        answers = yield [beam.tokens for _, beam in beams]
        grown: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for (p, beam), candidates in zip(beams, answers):
            for token, logprob in candidates.items():
                child = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [candidates],
                                           beam.cum_logprob + float(logprob))
                if token == eos and not params.ignore_eos:
                    child.finish_reason, child.stop_reason = "stop", token
                    done[p].append(child)
                else:
                    grown[p].append(child)
        live = [sorted(g, key=score, reverse=True)[:width] for g in grown]
    best = [sorted(d + l, key=score, reverse=True)[:width] for d, l in zip(done, live)]
    for beam in (beam for beams in best for beam in beams):
        beam.finish_reason = beam.finish_reason or "length"
    return best
