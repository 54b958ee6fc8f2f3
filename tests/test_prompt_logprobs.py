"""prompt_logprobs and the server's echo: the log-prob of every prompt token given the ones before it,
against transformers' forward over the whole prompt, in every way the engine may split the work (chunks, a
warm prefix cache, async scheduling, preemption, n > 1); and the legacy completions' echo as lm-eval's
loglikelihood requests send it."""
import random

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM

from nanoserve import LLM, SamplingParams
from nanoserve.course.generate import generate
from nanoserve.model.zoo import resolve_model
from nanoserve.serve.api_server import build_app

rng = random.Random(0)
PROMPTS = [[rng.randrange(1000) for _ in range(n)] for n in (5, 41, 23, 70, 1, 17)]


@pytest.fixture(scope="module")
def oracle():
    """Each prompt's log-softmax at every position, from transformers' model over the whole prompt."""
    hf = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-qwen3"), dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(torch.tensor([p])).logits[0].float().log_softmax(-1) for p in PROMPTS]


def check_scores(prompt, scores, want, k):
    assert len(scores) == len(prompt) and scores[0] is None
    for j in range(1, len(prompt)):
        entry, row = scores[j], want[j - 1]
        assert prompt[j] in entry and len(entry) in (k, k + 1)  # the top k, and the prompt's own token
        assert abs(entry[prompt[j]].logprob - row[prompt[j]].item()) < 1e-3
        # its rank, up to tokens within that same tolerance of it: the engine's chunked forward on two CPU
        # threads differs from transformers' by up to 1.3e-4 here, and near-uniform logits put tokens that close
        likelier = (row > row[prompt[j]] + 1e-3).sum().item(), (row > row[prompt[j]] - 1e-3).sum().item()
        assert likelier[0] + 1 <= entry[prompt[j]].rank <= likelier[1] + 1
        assert list(entry)[:k] == row.topk(k).indices.tolist()
        # ranks 1..k in that order: exact for the prompt's own token when it is among them (its rank is counted)
        assert [entry[t].rank for t in list(entry)[:k]] == list(range(1, k + 1))


@pytest.mark.parametrize("settings", [
    dict(max_num_batched_tokens=8192),
    dict(max_num_batched_tokens=7, enable_prefix_caching=True, async_scheduling=True),  # chunks, a warm cache
    dict(max_num_batched_tokens=16, num_gpu_blocks_override=12, block_size=8),  # a pool that preempts
])
def test_prompt_logprobs_match_a_forward_over_the_whole_prompt(oracle, settings):
    settings = {"num_gpu_blocks_override": 64, **settings}
    with LLM("tiny-qwen3", device="cpu", max_model_len=256, **settings) as llm:
        inputs = [{"prompt_token_ids": p} for p in PROMPTS]
        plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        alone = llm.generate(inputs, plain, use_tqdm=False)  # (also warms the prefix cache)
        scoring = plain.clone(prompt_logprobs=3, n=2)
        mixed = [scoring if i % 2 == 0 else plain for i in range(len(PROMPTS))]
        outs = llm.generate(inputs, mixed, use_tqdm=False)
        preempted = llm.engine.stats.preemptions
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs)):
        if i % 2:  # a batch-mate that does not score its prompt: untouched
            assert out.prompt_logprobs is None and out.outputs[0].token_ids == alone[i].outputs[0].token_ids
            continue
        check_scores(prompt, out.prompt_logprobs, oracle[i], 3)
        assert out.num_cached_tokens == 0  # a scoring request computes its whole prompt
        assert [c.token_ids for c in out.outputs] == [alone[i].outputs[0].token_ids] * 2
    if settings.get("block_size") == 8:
        assert preempted > 0


def test_refused_where_no_prompt_is_scored_or_beyond_max_logprobs():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="prompt_logprobs needs the engine"):
        generate(None, [[1, 2]], SamplingParams(prompt_logprobs=1))
    with LLM("tiny-qwen3", device="cpu", max_model_len=64, num_gpu_blocks_override=16, max_logprobs=2) as llm:
        with pytest.raises(ValueError, match="prompt_logprobs 3 exceeds max_logprobs 2"):
            llm.generate([[1, 2, 3]], SamplingParams(prompt_logprobs=3), use_tqdm=False)


@pytest.fixture(scope="module")
def client():
    with LLM("tiny-qwen3", device="cpu", max_model_len=256, num_gpu_blocks_override=64) as llm:
        with TestClient(build_app(llm, "tiny-qwen3")) as client:
            yield llm, client


def test_echo_as_lm_eval_asks_for_loglikelihoods(client, oracle):
    llm, client = client
    # lm-eval's local-completions: token prompts in a batch, echo, 1 log-prob, 1 new token, greedy
    body = {"model": "tiny-qwen3", "prompt": PROMPTS[1:4], "echo": True, "logprobs": 1, "max_tokens": 1,
            "temperature": 0, "seed": 1234}
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    for prompt, want, choice in zip(PROMPTS[1:4], oracle[1:4], reply.json()["choices"]):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None
        scored = torch.tensor(lp["token_logprobs"][1:-1])
        assert torch.allclose(scored, want[torch.arange(len(prompt) - 1), prompt[1:]], atol=1e-3)
        for j, top in enumerate(lp["top_logprobs"][1:-1]):  # the likeliest token, and the prompt's own
            assert max(top.values()) >= lp["token_logprobs"][j + 1] - 1e-6
            assert llm.tokenizer.decode([want[j].argmax().item()]) in top
        new = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1),
                           use_tqdm=False)[0].outputs[0]
        assert choice["text"] == llm.tokenizer.decode(prompt) + new.text
        assert choice["prompt_logprobs"] is None  # not asked for (echo's log-probs are in "logprobs")
    text = client.post("/v1/completions", json={"model": "tiny-qwen3", "prompt": "The sky is", "echo": True,
                                                "max_tokens": 2, "temperature": 0}).json()
    assert text["choices"][0]["text"].startswith("The sky is") and text["choices"][0]["logprobs"] is None


def test_prompt_logprobs_in_responses_and_refusals_by_name(client, oracle):
    llm, client = client
    reply = client.post("/v1/completions", json={"model": "tiny-qwen3", "prompt": PROMPTS[1], "max_tokens": 2,
                                                  "prompt_logprobs": 2}).json()
    scores = reply["choices"][0]["prompt_logprobs"]
    assert scores[0] is None and len(scores) == len(PROMPTS[1])
    for j in range(1, len(PROMPTS[1])):
        own = scores[j][str(PROMPTS[1][j])]
        assert abs(own["logprob"] - oracle[1][j - 1, PROMPTS[1][j]].item()) < 1e-3
        assert own["decoded_token"] == llm.tokenizer.decode([PROMPTS[1][j]]) and own["rank"] >= 1
    chat = client.post("/v1/chat/completions", json={"model": "tiny-qwen3", "max_tokens": 2, "prompt_logprobs": 0,
                                                     "messages": [{"role": "user", "content": "Hi"}]}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    for body, param in [({"prompt": [1, 2], "echo": True, "stream": True}, "echo"),
                        ({"prompt": [1, 2], "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
                        ({"prompt": [1, 2], "prompt_logprobs": 21}, "prompt_logprobs")]:
        refused = client.post("/v1/completions", json={"model": "tiny-qwen3", **body})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == llm.tokenizer.eos_token and info["model_max_length"] == 256
    assert info["chat_template"] == llm.tokenizer.chat_template


def test_a_rank_counts_the_likelier_tokens():
    """score_rows (both log-prob features): rank = 1 + how many tokens are likelier, exactly, on logits with no
    ties; the top k come in order with ranks 1..k (the transformers comparison above allows a window)."""
    from nanoserve.features.logprobs import logprob_entry, score_given, score_rows

    gen = torch.Generator().manual_seed(0)
    logits = torch.stack([torch.randperm(3000, generator=gen).float() / 100 for _ in range(5)])
    targets = torch.randint(0, 3000, (5,), generator=gen)
    values, indices, chosen, ranks = (t.tolist() for t in score_rows(logits, targets, 4))
    for r in range(5):
        assert ranks[r] == 3000 - int(logits[r, targets[r]].item() * 100 + 0.5)  # values 0..29.99: the largest is rank 1
        entry = logprob_entry(values[r], indices[r], 4, targets[r].item(), chosen[r], ranks[r])
        assert [entry[t].rank for t in indices[r]] == [1, 2, 3, 4] or targets[r].item() in indices[r]
    # and the ranks of given ids (logprob_token_ids): one sort, a binary search each
    ids = torch.randint(0, 3000, (5, 6), generator=gen)
    given = score_given(logits, ids)
    assert torch.allclose(given[:, :6], logits.log_softmax(-1).gather(1, ids))
    assert given[:, 6:].tolist() == (3000 - (logits.gather(1, ids) * 100).round()).tolist()


def test_logprob_token_ids_are_the_models_at_each_new_token(client):
    """logprob_token_ids: at each new token, the log-probs and ranks of exactly the given ids and the drawn
    token, against transformers' forward over prompt and output; batch-mates asking for a top-k, for fewer ids
    or for nothing draw what they draw alone."""
    llm, _ = client
    given = [3, 77, 1000, 151000]
    plain = SamplingParams(temperature=0.8, seed=1, max_tokens=5, ignore_eos=True)
    asks = [plain.clone(logprob_token_ids=given), plain.clone(logprobs=2), plain, plain.clone(logprob_token_ids=[77])]
    inputs = [{"prompt_token_ids": p} for p in PROMPTS[:4]]
    outs = llm.generate(inputs, asks, use_tqdm=False)
    alone = llm.generate(inputs, plain, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-qwen3"), dtype=torch.float32).eval()
    for prompt, params, out, want in zip(PROMPTS, asks, outs, alone):
        c = out.outputs[0]
        assert c.token_ids == want.outputs[0].token_ids
        if params.logprob_token_ids is None:
            assert c.logprobs is None if params.logprobs is None else all(len(e) in (2, 3) for e in c.logprobs)
            continue
        with torch.no_grad():
            rows = hf(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
        assert len(c.logprobs) == len(c.token_ids) == len(rows)
        for row, token, entry in zip(rows, c.token_ids, c.logprobs):
            assert set(entry) == {*params.logprob_token_ids, token}
            for t, lp in entry.items():
                assert abs(lp.logprob - row[t].item()) < 1e-3
                likelier = (row > row[t] + 1e-3).sum().item(), (row > row[t] - 1e-3).sum().item()
                assert likelier[0] + 1 <= lp.rank <= likelier[1] + 1
        assert abs(c.cumulative_logprob - sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs))) < 1e-4
    with pytest.raises(ValueError, match="logprob_token_ids: token ids must be below"):
        llm.generate(inputs[:1], plain.clone(logprob_token_ids=[10 ** 6]), use_tqdm=False)
    for wrong in ([1] * 129, [-1], 5):
        with pytest.raises(ValueError, match="logprob_token_ids"):
            SamplingParams(logprob_token_ids=wrong)
    with pytest.raises(ValueError, match="replaces logprobs' top-k"):
        SamplingParams(logprobs=3, logprob_token_ids=[1, 2])
