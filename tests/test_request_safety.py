"""What one request may do to the server and to its batch-mates: its template variables never reach
the renderer, a template of its own is bounded in time, memory and size, every route with a request's text
needs the key, its token ids are checked before it is queued, its constraints fail it alone (a 400 naming the
field, or its own error), and a flood of hostile requests leaves the server serving."""
import inspect
import logging
import statistics
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_serve_faults import running

from nanoserve import LLM, SamplingParams, StructuredOutputsParams
from nanoserve.serve.api_server import OPEN_ROUTES, build_app

MODEL = "tiny-qwen3"
KEY = {"Authorization": "Bearer k"}
HI = [{"role": "user", "content": "hi"}]
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def llm():
    with LLM(MODEL, max_model_len=512, max_num_seqs=8, num_gpu_blocks_override=96, device="cpu") as llm:
        yield llm


@pytest.fixture(scope="module")
def server(llm):
    """A server that trusts request templates (the harder case), with an API key."""
    app = build_app(llm, MODEL, api_key="k", trust_request_chat_template=True)
    app.state.template_workers.seconds = 2.0  # this test's budget (the server's default is 5 s)
    with running(app) as url:
        warm = post(url, "/v1/chat/completions", {"messages": HI, "max_tokens": 1, "chat_template": "x"})
        assert warm.status_code == 200, warm.text  # the workers started (they import transformers first)
        yield url, app


def post(url, path, body, headers=KEY, timeout=60):
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=timeout)


def refused(reply, param: str) -> str:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and len(error["message"]) < 600 and "Traceback" not in error["message"], error
    return error["message"]


# 1. Template variables only; every route with a request's text behind the key.

def test_no_keyword_of_the_renderer_is_reachable_from_chat_template_kwargs(server, monkeypatch):
    from transformers import PreTrainedTokenizerBase
    from transformers.utils import chat_template_utils

    url, _ = server
    calls = []
    real = chat_template_utils.render_jinja_template
    monkeypatch.setattr(chat_template_utils, "render_jinja_template", lambda *a, **k: calls.append(k) or real(*a, **k))
    keywords = [name for name, p in inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters.items()
                if p.kind is not p.VAR_KEYWORD] + ["messages", "tools", "documents", "add_generation_prompt"]
    values = {"chat_template": "<|im_start|>OWNED{{ 6*7 }}", "padding": "max_length", "max_length": 3_000_000,
              "tokenize": False, "tokenizer_kwargs": {"max_length": 10}, "truncation": True}
    for name in keywords:
        for path, body in (("/tokenize", {"messages": HI}), ("/v1/chat/completions", {"messages": HI, "max_tokens": 1})):
            reply = post(url, path, {**body, "chat_template_kwargs": {name: values.get(name, 1)}})
            assert name in refused(reply, "chat_template_kwargs")
    assert calls == []  # nothing was rendered for any of them
    plain = post(url, "/tokenize", {"messages": HI}).json()["tokens"]
    assert post(url, "/tokenize", {"messages": HI, "chat_template_kwargs": {"unread": 1}}).json()["tokens"] == plain
    thinking = post(url, "/tokenize", {"messages": HI, "chat_template_kwargs": {"enable_thinking": True}})
    assert thinking.json()["tokens"] != plain  # a variable the template reads still works (Qwen3's thinking)


def test_every_route_but_the_open_ones_needs_the_key(server):
    url, app = server
    routes = [(method.upper(), path) for path, methods in app.openapi()["paths"].items() for method in methods]
    routes += [("GET", "/docs"), ("GET", "/openapi.json")]
    assert {path for _, path in routes} >= {"/tokenize", "/detokenize", "/tokenizer_info", "/v1/models"}
    for method, path in routes + [("GET", "/no/such/route")]:
        reply = httpx.request(method, f"{url}{path}", json={}, timeout=30)
        assert (reply.status_code == 401) == (path not in OPEN_ROUTES), (method, path, reply.status_code)
        if path not in OPEN_ROUTES:
            assert httpx.request(method, f"{url}{path}", json={}, headers={"Authorization": "Bearer x"},
                                 timeout=30).status_code == 401


def test_a_template_without_the_flag_is_refused_even_through_kwargs(llm):
    with running(build_app(llm, MODEL)) as url:
        for body in ({"chat_template": "X{{ 6*7 }}"}, {"chat_template_kwargs": {"chat_template": "X{{ 6*7 }}"}}):
            reply = post(url, "/v1/chat/completions", {"messages": HI, "max_tokens": 1, **body})
            assert reply.status_code == 400 and "42" not in reply.text


def test_serve_takes_the_key_from_vllm_api_key(monkeypatch, capsys):
    import nanoserve.engine.llm
    import nanoserve.serve.api_server
    from nanoserve.cli import main

    seen = {}
    monkeypatch.setattr(nanoserve.engine.llm, "LLM", lambda *a, **k: type("Fake", (), {"tokenizer": None})())
    monkeypatch.setattr(nanoserve.serve.api_server, "serve", lambda llm, name, *a, **k: seen.update(key=a[3]))
    monkeypatch.setenv("VLLM_API_KEY", "secret")
    assert main(["serve", "tiny-qwen3", "--device", "cpu"]) == 0
    assert seen["key"] == "secret" and "VLLM_API_KEY" in capsys.readouterr().out
    assert main(["serve", "tiny-qwen3", "--device", "cpu", "--api-key", "flag"]) == 0 and seen["key"] == "flag"


# 2. A request's own template: bounded, and its errors are 400s naming chat_template.

@pytest.mark.parametrize("template", [
    LOOP, "{% set s = 'x' * 300000000 %}{{ s }}", "{{ 1/0 }}", "{% include 'a' %}", "{{ range(10**9) | list }}",
    "{{ 10**(10**6) }}", "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "{{ 'x' * 20000000 }}"])
def test_a_request_template_is_bounded_and_its_errors_are_400s(server, template):
    url, _ = server
    start = time.monotonic()
    refused(post(url, "/v1/chat/completions", {"messages": HI, "max_tokens": 1, "chat_template": template}),
            "chat_template")
    assert time.monotonic() - start < 10
    # the workers are still there: a killed one is replaced (on a loaded machine that takes a while, so "busy,
    # retry later" is allowed until then, as a client would retry)
    deadline = time.monotonic() + 60
    while True:
        ok = post(url, "/v1/chat/completions", {"messages": HI, "max_tokens": 2,
                                                "chat_template": "<|im_start|>user\n{{ messages[0]['content'] }}"})
        if ok.status_code == 200 or "retry later" not in ok.text or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert ok.status_code == 200, ok.text


def test_the_server_keeps_serving_through_a_flood_of_hostile_requests(server, llm):
    """16 clients at once: looping templates, grammars that take seconds to refuse, broken tool schemas.
    Meanwhile /health answers fast and an ordinary completion comes back within seconds."""
    url, _ = server
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
    hostile = ([{"messages": HI, "max_tokens": 1, "chat_template": LOOP}] * 8
               + [{"messages": HI, "max_tokens": 1, "guided_regex": "a{1000000000}"}] * 4
               + [{"messages": HI, "max_tokens": 1, "tools": [tool], "tool_choice": "required"}] * 4)
    replies = []
    threads = [threading.Thread(target=lambda b=b: replies.append(_try(url, b))) for b in hostile]
    for t in threads:
        t.start()
    time.sleep(0.5)
    health = []
    for _ in range(20):
        start = time.monotonic()
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        health.append(time.monotonic() - start)
        time.sleep(0.05)
    start = time.monotonic()
    ok = post(url, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}, timeout=30)
    assert ok.status_code == 200 and time.monotonic() - start < 10
    for t in threads:
        t.join(60)
    # (100 ms on an idle machine; loose here for a loaded CI machine: before, /health stopped for 8-30 s)
    assert statistics.median(health) < 0.5 and max(health) < 2.0, health
    assert all(r is None or r.status_code in (400, 503) for r in replies), [r.text[:100] for r in replies if r]


def _try(url, body):
    try:  # the client gives up after 5 s, as the did
        return post(url, "/v1/chat/completions", body, timeout=5)
    except httpx.TimeoutException:
        return None


def test_stopping_the_server_does_not_wait_for_a_looping_template(llm):
    app = build_app(llm, MODEL, trust_request_chat_template=True)
    app.state.template_workers.seconds = 30.0  # longer than the stop may take
    with running(app) as url:
        assert post(url, "/v1/chat/completions", {"messages": HI, "max_tokens": 1, "chat_template": "x"}).is_success
        workers = list(app.state.template_workers.running)
        client = threading.Thread(target=_try, args=(url, {"messages": HI, "max_tokens": 1, "chat_template": LOOP}))
        client.start()
        time.sleep(1)
    assert all(proc.returncode is not None for proc in workers)  # killed, not left looping
    client.join(10)


# 3. Token ids and constraints: checked before anything is queued, or failing their own request only.

@pytest.mark.parametrize("field, value", [("stop_token_ids", [151946]), ("stop_token_ids", [2**64]),
                                          ("logit_bias", {"999999": 1}), ("allowed_token_ids", [151936])])
def test_token_ids_beyond_the_vocabulary_are_refused_naming_their_field(server, llm, field, value):
    url, _ = server
    refused(post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 1, field: value}), field)
    params = SamplingParams(max_tokens=2, min_tokens=1, **{field: {int(k): v for k, v in value.items()}
                                                           if isinstance(value, dict) else value})
    with pytest.raises(ValueError, match=field) as raised:
        llm.generate(["hi", "bystander"], [params, SamplingParams(max_tokens=2)], use_tqdm=False)
    assert raised.value.param == field
    assert not llm.engine.has_unfinished()


def test_constraints_that_leave_no_token_are_refused_or_fail_alone(llm):
    tokenizer = llm.tokenizer
    word = tokenizer.encode(" hello", add_special_tokens=False)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(["hi"], SamplingParams(allowed_token_ids=word, bad_words=["hello"]), use_tqdm=False)
    with pytest.raises(ValueError, match="min_tokens"):
        llm.generate(["hi"], SamplingParams(allowed_token_ids=sorted(llm.engine.eos), min_tokens=2), use_tqdm=False)
    # Found only as it generates: a grammar that wants "yes" while only " hello" is allowed
    yes = SamplingParams(max_tokens=4, temperature=1.0, seed=3, allowed_token_ids=word,
                         structured_outputs=StructuredOutputsParams(choice=["yes"]))
    out, bystander = llm.generate(["hi", "hi"], [yes, SamplingParams(max_tokens=4, temperature=0)], use_tqdm=False)
    assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []
    assert "structured_outputs" in out.error or "allowed_token_ids" in out.error
    alone = llm.generate(["hi"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
    assert bystander.outputs[0].token_ids == alone.outputs[0].token_ids


FIELDS = {
    "temperature": st.sampled_from([0.0, 0.7, 1.5]), "top_k": st.sampled_from([0, 1, 5]),
    "top_p": st.sampled_from([1.0, 0.5]), "min_p": st.sampled_from([0.0, 0.2, 1.0]),
    "seed": st.one_of(st.none(), st.integers(0, 2**70)), "max_tokens": st.integers(1, 4),
    "min_tokens": st.integers(0, 5), "n": st.integers(1, 3), "ignore_eos": st.booleans(),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 2**64), max_size=3),
    "logit_bias": st.dictionaries(st.integers(0, 200_000), st.floats(-200, 200), max_size=4),
    "allowed_token_ids": st.one_of(st.none(), st.lists(st.integers(0, 152_000), min_size=1, max_size=4)),
    "bad_words": st.lists(st.text("abc hi", min_size=1, max_size=4).filter(str.strip), max_size=3),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.sampled_from([1.0, 0.5, 2.0]), "logprobs": st.one_of(st.none(), st.integers(0, 5)),
    "prompt_logprobs": st.one_of(st.none(), st.integers(0, 3)), "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(), "truncate_prompt_tokens": st.one_of(st.none(), st.integers(1, 3)),
    "structured_outputs": st.one_of(st.none(), st.sampled_from(
        [StructuredOutputsParams(choice=["yes", "no"]), StructuredOutputsParams(regex="[ab]{1,3}")])),
}


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.fixed_dictionaries({}, optional=FIELDS), st.booleans())
def test_no_accepted_sampling_params_raises_inside_a_step(llm, fields, batched):
    """Whatever SamplingParams accepts either raises ValueError before anything runs, or runs: its own
    request may end with an error of its own constraints, never with a token it forbade, and a bystander's
    tokens are what they are alone."""
    try:
        params = SamplingParams(**fields)
    except ValueError:
        return
    bystander = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    prompts, all_params = (["hi there", "bystander"], [params, bystander]) if batched else (["hi there"], [params])
    try:
        outs = llm.generate(prompts, all_params, use_tqdm=False)
    except ValueError:  # a parameter this model cannot take: refused before anything ran
        assert not llm.engine.has_unfinished()
        return
    for completion in outs[0].outputs:
        if completion.finish_reason == "error":
            assert "forbid every token" in outs[0].error or "structured_outputs" in outs[0].error, outs[0].error
        if params.allowed_token_ids is not None:
            assert set(completion.token_ids) <= set(params.allowed_token_ids)
    if batched:
        alone = llm.generate(["bystander"], bystander, use_tqdm=False)[0]
        assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids


# 4. Grammars, tools and the other faults: 400s naming the field, small, before admission.

def test_constraints_llguidance_refuses_late_are_400s_naming_their_field(server):
    url, _ = server
    gbnf = "root ::= r0\n" + "".join(f'r{i} ::= "a" r{i + 1} | "b"\n' for i in range(1500)) + 'r1500 ::= "z"\n'
    cases = [({"guided_regex": "a{1000000000}"}, "guided_regex"), ({"guided_grammar": 'start: a\na: a "x"'},
             "guided_grammar"), ({"structured_outputs": {"grammar": gbnf}}, "structured_outputs"),
             ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
              "response_format")]
    for body, field in cases:
        start = time.monotonic()
        refused(post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **body}), field)
        assert time.monotonic() - start < 15


def test_tool_mistakes_are_400s_naming_tools_or_tool_choice(server):
    url, _ = server
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
    unknown_ref = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/nope"}}}
    cases = [({"tools": [], "tool_choice": "required"}, "tool_choice"),
             ({"tools": [broken], "tool_choice": "required"}, "tools"),
             ({"tools": [unknown_ref], "tool_choice": "required"}, "tools"),
             ({"tools": [tool], "tool_choice": {"type": "function", "function": "a"}}, "tool_choice"),
             ({"tools": ["f"]}, "tools")]
    for body, field in cases:
        refused(post(url, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, **body}), field)


def test_errors_name_the_right_field_and_stay_small(server):
    url, _ = server
    refused(post(url, "/v1/chat/completions", {"messages": HI, "min_tokens": 10**9}), "min_tokens")
    bias = {str(i): 1 for i in range(150_000)} | {"x": 1}
    refused(post(url, "/v1/completions", {"prompt": "hi", "logit_bias": bias}), "logit_bias")
    refused(post(url, "/tokenize", {"messages": []}), "messages")


def test_a_client_leaving_an_unstreamed_request_logs_no_traceback(server, caplog):
    url, _ = server
    with caplog.at_level(logging.WARNING):
        with pytest.raises(httpx.TimeoutException):
            post(url, "/v1/completions", {"prompt": [5, 6], "max_tokens": 400, "ignore_eos": True}, timeout=0.5)
        time.sleep(1.5)
    assert not [r for r in caplog.records if r.exc_info or "CancelledError" in r.getMessage()]


def test_prompt_logprobs_scored_in_small_chunks_are_the_same(llm, monkeypatch):
    from nanoserve.engine import model_runner

    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    prompt = list(range(100, 140))
    whole = llm.generate([prompt], params, use_tqdm=False)[0]
    monkeypatch.setattr(model_runner, "LOGIT_ROWS", 3)
    chunked = llm.generate([prompt], params, use_tqdm=False)[0]
    assert chunked.outputs[0].token_ids == whole.outputs[0].token_ids
    # A matmul of 3 rows rounds a little differently from one of 40: values agree to 1e-3, and the top tokens
    # (random logits are near ties) agree at nearly every position
    pairs = list(zip(whole.prompt_logprobs[1:], chunked.prompt_logprobs[1:]))
    assert all(abs(a[t] - b[t]) < 1e-3 for a, b in pairs for t in a.keys() & b.keys())
    assert sum(a.keys() == b.keys() for a, b in pairs) >= 0.9 * len(pairs)


def test_tokenize_renders_a_request_template_through_the_workers_too(server, llm):
    url, _ = server
    reply = post(url, "/tokenize", {"messages": HI, "chat_template": "A{{ messages[0]['content'] }}B"})
    assert reply.status_code == 200 and reply.json()["tokens"] == llm.tokenizer.encode("AhiB", add_special_tokens=False)
    refused(post(url, "/tokenize", {"messages": HI, "chat_template": "{{ 1/0 }}"}), "chat_template")
    refused(post(url, "/tokenize", {"messages": HI, "chat_template": LOOP}), "chat_template")


def test_text_too_long_to_fit_is_refused_before_it_is_tokenised(server):
    """A 7.5 MiB prompt cannot fit 512 tokens of a vocabulary whose longest token has 128 characters: refused
    at once, naming it, while /health answers (the tokenizer would hold the GIL for long stretches)."""
    url, _ = server
    text = "hello world " * 655_360
    for path, body, param in (("/tokenize", {"prompt": text, "return_token_strs": True}, "prompt"),
                              ("/v1/completions", {"prompt": text, "max_tokens": 1}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}, "messages")):
        start = time.monotonic()
        refused(post(url, path, body), param)
        assert time.monotonic() - start < 5
    ok = post(url, "/v1/completions", {"prompt": text, "max_tokens": 1, "truncate_prompt_tokens": 8})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 8


def test_prompt_scorer_scores_each_chunk_and_keeps_none_of_them_alive():
    """The scorer gives what one log_softmax over all the rows gives, and what it returns (the sampled rows)
    holds only those rows' memory: a view would keep a whole chunk, thousands of vocab-wide rows, alive."""
    import torch

    from nanoserve.features.logprobs import PromptScorer

    torch.manual_seed(0)
    logits = torch.randn(12, 50)
    targets = torch.randint(0, 50, (10,)).tolist()
    scorer = PromptScorer(2, targets, 3)
    kept = scorer.take(iter(logits.split(4)))
    assert torch.equal(kept, logits[:2]) and kept.untyped_storage().nbytes() == 2 * 50 * 4
    logprobs = logits[2:].log_softmax(dim=-1)
    values, indices, chosen, ranks = scorer.scores
    assert torch.allclose(values, logprobs.topk(3).values) and torch.equal(indices, logprobs.topk(3).indices)
    assert torch.allclose(chosen, logprobs[torch.arange(10), targets])
    scored = logits[2:]  # a rank counts the likelier tokens: exactly, on the logits (log-probs round)
    assert torch.equal(ranks, (scored > scored[torch.arange(10), targets][:, None]).sum(-1) + 1)


def test_llm_chat_refuses_renderer_keywords_in_chat_template_kwargs(llm):
    for name in ("chat_template", "tokenize", "padding", "max_length", "messages"):
        with pytest.raises(ValueError, match=f"chat_template_kwargs: {name}"):
            llm.chat(HI, SamplingParams(max_tokens=1), chat_template_kwargs={name: 1}, use_tqdm=False)
    thinking = llm.chat(HI, SamplingParams(max_tokens=1), chat_template_kwargs={"enable_thinking": True},
                        use_tqdm=False)[0]
    assert thinking.prompt_token_ids != llm.chat(HI, SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids
