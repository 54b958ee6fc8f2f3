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
    """For each prompt, its params.beam_width best beams. concurrency_limit: at most that many prompts'
    beams in the engine at once (all of them by default)."""
    if 2 * params.beam_width > llm.max_logprobs:
        raise ValueError(f"beam_width {params.beam_width} asks for {2 * params.beam_width} log-probs a token, "
                         f"over max_logprobs {llm.max_logprobs} (LLM(max_logprobs=...) raises the limit)")
    encoded = llm._encode(prompts)
    step = max(1, concurrency_limit or len(encoded))
    out = []
    for start in range(0, len(encoded), step):
        out += search([ids for _, ids in encoded[start:start + step]], llm, params, use_tqdm)
    return out


def search(prompts: list[list[int]], llm, params: BeamSearchParams, use_tqdm: bool) -> list[BeamSearchOutput]:
    eos, width = llm.tokenizer.eos_token_id, params.beam_width
    one_token = SamplingParams(max_tokens=1, logprobs=2 * width, temperature=params.temperature, detokenize=False)
    live = [[BeamSearchSequence(list(ids))] for ids in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        beams = [(p, beam) for p, beams in enumerate(live) for beam in beams]
        if not beams:
            break
        outputs = llm.generate([{"prompt_token_ids": beam.tokens} for _, beam in beams], one_token,
                               use_tqdm=use_tqdm)
        grown: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for (p, beam), output in zip(beams, outputs):
            if output.error:
                raise RuntimeError(f"beam search, prompt {p}: {output.error}")
            candidates = output.outputs[0].logprobs[0]
            for token, logprob in candidates.items():
                child = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [candidates],
                                           beam.cum_logprob + float(logprob))
                if token == eos and not params.ignore_eos:
                    child.finish_reason, child.stop_reason = "stop", token
                    done[p].append(child)
                else:
                    grown[p].append(child)
        live = [sorted(g, key=lambda b: beam_score(b, eos, params.length_penalty), reverse=True)[:width]
                for g in grown]
    results = []
    for p, ids in enumerate(prompts):
        best = sorted(done[p] + live[p], key=lambda b: beam_score(b, eos, params.length_penalty),
                      reverse=True)[:width]
        for beam in best:
            beam.finish_reason = beam.finish_reason or "length"
            keep = beam.tokens if beam.finish_reason == "length" or params.include_stop_str_in_output \
                else beam.tokens[:-1]
            beam.text = llm.tokenizer.decode(keep)
        results.append(BeamSearchOutput(best))
    return results
