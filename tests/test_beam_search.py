"""LLM.beam_search, vLLM's: the beams equal those of a beam search written here on transformers' log-probabilities
(the same rule: 2 x beam_width candidates a beam, kept by summed log-probability over length ** length_penalty),
an end-of-text token completes a beam, and what cannot be had is refused by name."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from nanoserve import LLM
from nanoserve.beam_search import BeamSearchOutput
from nanoserve.model.zoo import resolve_model
from nanoserve.sampling_params import BeamSearchParams

PROMPTS = ["The capital of France is", "Once upon a time"]


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-qwen3", device="cpu", max_model_len=256, num_gpu_blocks_override=128) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf():
    return AutoModelForCausalLM.from_pretrained(resolve_model("tiny-qwen3"), dtype=torch.float32).eval()


def reference(hf, ids: list[int], width: int, steps: int, eos: int, length_penalty: float,
              eos_below_top: dict | None = None) -> list[tuple]:
    """(tokens, summed log-probability) of the best `width` beams, each step's log-probs from a full forward;
    eos_below_top: {beam length: how far below the likeliest token the end-of-text token's logit is set there}."""
    def score(beam):
        tokens, total = beam
        return total / max(len(tokens) - (tokens[-1] == eos), 1) ** length_penalty

    live, done = [(list(ids), 0.0)], []
    for _ in range(steps):
        grown = []
        for tokens, total in live:
            with torch.no_grad():
                logits = hf(torch.tensor([tokens])).logits[0, -1]
            if len(tokens) in (eos_below_top or {}):
                logits[eos] = logits.max() - eos_below_top[len(tokens)]
            logprobs = logits.log_softmax(-1)
            top = logprobs.topk(2 * width)
            for value, token in zip(top.values.tolist(), top.indices.tolist()):
                (done if token == eos else grown).append((tokens + [token], total + value))
        live = sorted(grown, key=score, reverse=True)[:width]
    return sorted(done + live, key=score, reverse=True)[:width]


@pytest.mark.parametrize("width, length_penalty", [(2, 1.0), (3, 0.5)])
def test_beams_equal_a_beam_search_on_transformers_log_probs(llm, hf, width, length_penalty):
    params = BeamSearchParams(beam_width=width, max_tokens=4, length_penalty=length_penalty)
    outputs = llm.beam_search([{"prompt": p} for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, outputs):
        ids = llm.tokenizer.encode(prompt)
        want = reference(hf, ids, width, 4, llm.tokenizer.eos_token_id, length_penalty)
        assert isinstance(out, BeamSearchOutput) and len(out.sequences) == width
        assert [s.tokens for s in out.sequences] == [tokens for tokens, _ in want]
        for beam, (_, total) in zip(out.sequences, want):
            assert beam.cum_logprob == pytest.approx(total, abs=1e-3)
            assert beam.cum_logprob == pytest.approx(sum(float(step[t]) for step, t in
                                                         zip(beam.logprobs, beam.tokens[len(ids):])), abs=1e-6)
            assert beam.finish_reason == "length" and beam.text == llm.tokenizer.decode(beam.tokens)


@pytest.mark.parametrize("length_penalty", [0.5, 2.0])
def test_an_end_of_text_token_completes_a_beam(llm, hf, length_penalty):
    """The end-of-text token's logit set just below the likeliest token's at two lengths (by a hook on the model's
    output, here and in the reference), so that some beams end there and others go on: completed beams stop growing and compete with
    longer ones by score (the length penalty decides), finish_reason "stop", their text without the token unless
    include_stop_str_in_output; with ignore_eos every beam goes on."""
    eos = llm.tokenizer.eos_token_id
    prompt = llm.tokenizer.encode("Hello")
    below = {len(prompt) + 1: 1.5, len(prompt) + 3: 0.5}
    model, length = llm.engine.runner.model, [0]
    original, real_generate = model.compute_logits, llm.generate

    def biased(hidden):
        logits = original(hidden)
        if length[0] in below:
            logits[:, eos] = logits.max(-1).values - below[length[0]]
        return logits

    def generate(prompts, *args, **kwargs):  # every beam of a round is as long as the others
        length[0] = len(prompts[0]["prompt_token_ids"])
        return real_generate(prompts, *args, **kwargs)

    model.compute_logits, llm.generate = biased, generate
    try:
        run = lambda **kw: llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=5,
                                                                      length_penalty=length_penalty, **kw))[0]
        stopped, kept, ignored = run(), run(include_stop_str_in_output=True), run(ignore_eos=True)
    finally:
        model.compute_logits = original
        del llm.generate
    want = reference(hf, prompt, 3, 5, eos, length_penalty, below)
    assert [b.tokens for b in stopped.sequences] == [tokens for tokens, _ in want]
    assert [b.cum_logprob for b in stopped.sequences] == pytest.approx([total for _, total in want], abs=1e-3)
    ended = [b for b in stopped.sequences if b.tokens[-1] == eos]
    assert ended and len({len(b.tokens) for b in stopped.sequences}) > 1  # complete and live beams competed
    for beam in stopped.sequences:
        assert beam.finish_reason == ("stop" if beam in ended else "length")
        assert beam.text == llm.tokenizer.decode(beam.tokens[:-1] if beam in ended else beam.tokens)
    assert [b.text for b in kept.sequences] == [llm.tokenizer.decode(b.tokens) for b in stopped.sequences]
    assert all(len(b.tokens) == len(prompt) + 5 and b.finish_reason == "length" for b in ignored.sequences)


def test_what_beam_search_cannot_do_is_refused_by_name(llm):
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=llm.max_logprobs, max_tokens=2))
    with pytest.raises(NotImplementedError, match="LoRA"):
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=2), lora_request=object())


def test_each_round_grows_beam_width_beams_a_prompt_and_concurrency_limit_changes_nothing(llm):
    """Round after round the engine gets beam_width beams of each prompt (one, the prompt, at first), at most
    concurrency_limit prompts' at a time; the beams are the same either way."""
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    sizes, real_generate = [], llm.generate

    def generate(prompts, *args, **kwargs):
        sizes.append(len(prompts))
        return real_generate(prompts, *args, **kwargs)

    llm.generate = generate
    try:
        together = llm.beam_search(PROMPTS, params)
        rounds, sizes[:] = list(sizes), []
        one_by_one = llm.beam_search(PROMPTS, params, concurrency_limit=1)
    finally:
        del llm.generate
    assert rounds == [2, 4, 4] and sizes == [1, 2, 2, 1, 2, 2]
    assert [[s.tokens for s in o.sequences] for o in together] == [[s.tokens for s in o.sequences]
                                                                    for o in one_by_one]


def test_the_server_beam_searches_on_completions_and_chats(llm):
    """vLLM's use_beam_search: on /v1/completions n beams a prompt, the best first, their text what follows the
    prompt, the same beams as LLM.beam_search's; on a chat, n beams as messages; what beam search cannot honour
    is refused by name."""
    from fastapi.testclient import TestClient

    from nanoserve.serve.api_server import build_app

    body = {"prompt": [PROMPTS[0], PROMPTS[1], PROMPTS[0]], "n": 2, "max_tokens": 4, "use_beam_search": True,
            "length_penalty": 0.7}
    want = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=0.7))
    with TestClient(build_app(llm, "tiny")) as client:
        reply = client.post("/v1/completions", json=body).json()
        texts = [choice["text"] for choice in sorted(reply["choices"], key=lambda c: c["index"])]
        for (p, j), text in zip([(p, j) for p in (0, 1, 0) for j in range(2)], texts):
            beam = want[p].sequences[j]
            assert text == llm.tokenizer.decode(beam.tokens[len(llm.tokenizer.encode(PROMPTS[p])):])
        assert texts[0] != texts[1] and texts[:2] == texts[4:]
        assert reply["usage"]["completion_tokens"] == 6 * 4
        for extra, param in (({"top_p": 0.5}, "top_p"), ({"stream": True}, "stream"), ({"n": 11}, "n"),
                             ({"logprobs": 2}, "logprobs"), ({"return_token_ids": True}, "return_token_ids")):
            refused = client.post("/v1/completions", json={**body, **extra})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.json()
        chat = {"messages": [{"role": "user", "content": "Hi"}], "use_beam_search": True, "n": 2, "max_tokens": 3}
        choices = client.post("/v1/chat/completions", json=chat).json()["choices"]
        assert [c["index"] for c in choices] == [0, 1] and choices[0]["message"]["content"] != \
            choices[1]["message"]["content"] and all(c["finish_reason"] == "length" for c in choices)
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        refused = client.post("/v1/chat/completions", json={**chat, "tools": tools})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"
