"""Every request field of OpenAI's schemas and vLLM's extra parameters: it works, or the server refuses
it with HTTP 400 naming it -- never accepted and dropped (a field of neither is ignored with a warning, as vLLM
does: tests/test_server_vllm.py). Those that work are checked for their effect: the
server's tokens equal LLM.generate's with the same SamplingParams, whose effects tests/test_logits_processors.py
checks against oracles."""
import typing

import openai
import pytest
from fastapi.testclient import TestClient
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from nanoserve import LLM, SamplingParams
from nanoserve.serve.api_server import build_app

PROMPT = [5, 6, 7, 8]
CHAT = [{"role": "user", "content": "Say something."}]
# A value that does something, for every field of OpenAI's request schemas (a field added to the openai
# package fails test_every_openai_field_is_known until it is listed here, and so decided on).
OPENAI_VALUES = {
    "model": "tiny-qwen3", "prompt": PROMPT, "messages": CHAT, "max_tokens": 3, "max_completion_tokens": 3,
    "temperature": 0.5, "top_p": 0.9, "n": 2, "seed": 3, "stop": ["\n"], "stream_options": {"include_usage": True},
    "presence_penalty": 1.0, "frequency_penalty": 1.0, "logit_bias": {"17": 50}, "logprobs": 2, "top_logprobs": 2,
    "user": "u", "metadata": {"k": "v"}, "store": True, "service_tier": "auto", "prompt_cache_key": "k",
    "prompt_cache_retention": "24h", "prompt_cache_options": {}, "safety_identifier": "s",
    "prediction": {"type": "content", "content": "x"}, "parallel_tool_calls": False,
    "best_of": 3, "echo": True, "suffix": "!", "response_format": {"type": "json_object"},
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool_choice": "auto",
    "functions": [{"name": "f"}], "function_call": "auto", "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"], "reasoning_effort": "low", "web_search_options": {}, "verbosity": "low",
    "moderation": {"model": "x"},
}
# vLLM's extra parameters (its protocol's sampling and chat fields), with a value that does something
VLLM_VALUES = {
    "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.3, "min_tokens": 2, "stop_token_ids": [17],
    "include_stop_str_in_output": True, "ignore_eos": True, "skip_special_tokens": False,
    "allowed_token_ids": [11, 12], "bad_words": ["the"], "truncate_prompt_tokens": 2, "request_id": "r",
    "prompt_logprobs": 1, "use_beam_search": True, "length_penalty": 0.5, "structured_outputs": {"choice": ["a"]},
    "guided_json": {}, "guided_regex": "a+", "guided_choice": ["a"], "guided_grammar": 'root ::= "a"',
    "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": " ", "priority": 1,
    "spaces_between_special_tokens": False, "return_tokens_as_token_ids": True, "return_token_ids": True,
    "chat_template": "{{ 'x' }}",
    "chat_template_kwargs": {"enable_thinking": True}, "add_generation_prompt": False,
    "continue_final_message": True, "documents": [{"text": "d"}],
}
WORKS = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "seed",
         "stop", "stream_options", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs",
         "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "include_stop_str_in_output",
         "ignore_eos", "skip_special_tokens", "allowed_token_ids", "bad_words", "truncate_prompt_tokens",
         "chat_template_kwargs", "continue_final_message", "add_generation_prompt", "prompt_logprobs",
         "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
         "tools", "tool_choice", "parallel_tool_calls", "return_token_ids", "return_tokens_as_token_ids",
         "spaces_between_special_tokens"}
NO_EFFECT_ON_OUTPUT = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "prompt_cache_retention",
                       "prompt_cache_options", "safety_identifier", "prediction", "request_id"}


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-qwen3", device="cpu", max_model_len=512, num_gpu_blocks_override=128) as llm:
        yield llm


@pytest.fixture(scope="module")
def client(llm):
    with TestClient(build_app(llm, "tiny-qwen3")) as client:
        yield client


def fields(schema) -> set[str]:
    return set(typing.get_type_hints(schema))


def test_every_openai_field_is_known():
    known = set(OPENAI_VALUES)
    for schema in (completion_create_params.CompletionCreateParamsBase, chat_create_params.CompletionCreateParamsBase):
        assert fields(schema) <= known, f"decide on {sorted(fields(schema) - known)}"


def body_for(endpoint: str, name: str | None = None, value=None) -> dict:
    body = {"model": "tiny-qwen3", "max_tokens": 3, "temperature": 0}
    body.update({"prompt": PROMPT} if endpoint == "completions" else {"messages": CHAT})
    if name is None:
        pass
    elif name in ("logprobs", "top_logprobs") and endpoint == "chat/completions":
        body.update(logprobs=True, top_logprobs=2)
    elif name == "tool_choice":  # (it needs tools)
        body.update(tools=OPENAI_VALUES["tools"], tool_choice=value)
    elif name == "stream_options":
        body.update(stream=True, stream_options=value)
    elif name in ("continue_final_message", "add_generation_prompt"):
        body.update(messages=CHAT + [{"role": "assistant", "content": "Well"}], add_generation_prompt=False,
                    continue_final_message=name == "continue_final_message")
    else:
        body[name] = value
    return body


CASES = [(endpoint, name) for endpoint, schema in (("completions", completion_create_params.CompletionCreateParamsBase),
                                                    ("chat/completions", chat_create_params.CompletionCreateParamsBase))
         for name in sorted(fields(schema) | set(VLLM_VALUES)) if not (endpoint == "completions" and name in (
             "messages", "max_completion_tokens", "top_logprobs", "chat_template_kwargs", "continue_final_message",
             "add_generation_prompt")) and not (endpoint == "chat/completions" and name in ("prompt", "suffix"))]


@pytest.mark.parametrize("endpoint, name", CASES, ids=[f"{e}:{n}" for e, n in CASES])
def test_each_field_works_or_is_refused_by_name(client, endpoint, name):
    value = {**OPENAI_VALUES, **VLLM_VALUES}[name]
    reply = client.post(f"/v1/{endpoint}", json=body_for(endpoint, name, value))
    if name in WORKS or name in NO_EFFECT_ON_OUTPUT or name == "use_beam_search" or \
            (name, endpoint) == ("echo", "completions"):
        assert reply.status_code == 200, reply.text
    else:
        assert reply.status_code == 400, (name, reply.text)
        error = reply.json()["error"]
        assert error["param"] == name and name in error["message"], error


def test_a_malformed_tool_call_in_a_message_is_refused(client):
    reply = client.post("/v1/chat/completions", json={**body_for("chat/completions"), "messages": [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages", reply.text


@pytest.mark.parametrize("extra", [dict(presence_penalty=2.0, temperature=2.0, seed=1, max_tokens=24),
                                   dict(frequency_penalty=2.0, temperature=2.0, seed=2, max_tokens=24),
                                   dict(logit_bias={"17": 100}), dict(repetition_penalty=1.6),
                                   dict(min_p=0.3, temperature=1.5, seed=3), dict(allowed_token_ids=[11, 12, 13]),
                                   dict(stop_token_ids=[17], logit_bias={"17": 100}), dict(min_tokens=4, max_tokens=8, logit_bias="EOS"),
                                   dict(truncate_prompt_tokens=2), dict(bad_words=["the", "a b"])])
def test_the_openai_client_gets_what_llm_generate_gives(llm, client, extra):
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)
    extra = {"temperature": 0, "max_tokens": 10, **extra}
    if extra.get("logit_bias") == "EOS":  # the end-of-sequence token as the likeliest: min_tokens holds it off
        extra["logit_bias"] = {str(min(llm.eos_token_ids)): 100}
    openai_names = {"presence_penalty", "frequency_penalty", "logit_bias", "temperature", "max_tokens", "seed"}
    reply = api.completions.create(model="tiny-qwen3", prompt=PROMPT, **{k: v for k, v in extra.items() if k in openai_names},
                                   extra_body={k: v for k, v in extra.items() if k not in openai_names})
    want = llm.generate([PROMPT], SamplingParams(**extra), use_tqdm=False)[0]
    assert reply.choices[0].text == want.outputs[0].text
    assert reply.choices[0].finish_reason == want.outputs[0].finish_reason
    assert reply.usage.prompt_tokens == len(want.prompt_token_ids)
    plain = llm.generate([PROMPT], SamplingParams(temperature=extra["temperature"], max_tokens=extra["max_tokens"],
                                                  seed=extra.get("seed")), use_tqdm=False)[0].outputs[0]
    if "bad_words" not in extra:  # (these words may simply not come up)
        assert (want.outputs[0].token_ids != plain.token_ids or want.prompt_token_ids != PROMPT), extra


def test_chat_template_kwargs_and_continuing_the_last_message(client, llm):
    think = client.post("/v1/chat/completions", json={**body_for("chat/completions"),
                                                      "chat_template_kwargs": {"enable_thinking": True}})
    plain = client.post("/v1/chat/completions", json=body_for("chat/completions"))
    assert think.json()["usage"]["prompt_tokens"] != plain.json()["usage"]["prompt_tokens"]
    cont = client.post("/v1/chat/completions", json=body_for("chat/completions", "continue_final_message", True))
    assert cont.status_code == 200
    ids = llm.tokenizer.apply_chat_template(CHAT + [{"role": "assistant", "content": "Well"}], tokenize=True,
                                            continue_final_message=True, enable_thinking=False)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert cont.json()["usage"]["prompt_tokens"] == len(ids)


def test_generation_config_defaults_apply_to_what_a_request_leaves_out(tmp_path, client, llm):
    import json
    import shutil

    from nanoserve.model.zoo import resolve_model

    folder = tmp_path / "model"
    shutil.copytree(resolve_model("tiny-qwen3"), folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0, "top_k": 7,
                                                               "max_new_tokens": 5}))
    with LLM(str(folder), device="cpu", max_model_len=256, num_gpu_blocks_override=64) as tuned:
        assert tuned.get_default_sampling_params() == SamplingParams(temperature=0.0, top_k=7, max_tokens=5)
        out = tuned.generate([PROMPT], use_tqdm=False)[0].outputs[0]  # greedy, 5 tokens: the file's defaults
        assert out.token_ids == llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5),
                                             use_tqdm=False)[0].outputs[0].token_ids
        with TestClient(build_app(tuned, "tuned")) as tuned_client:
            body = {"model": "tuned", "prompt": PROMPT}
            left_out = tuned_client.post("/v1/completions", json=body).json()
            assert left_out["usage"]["completion_tokens"] == 5 and left_out["choices"][0]["text"] == out.text
            given = tuned_client.post("/v1/completions", json={**body, "max_tokens": 2}).json()  # the request's wins
            assert given["usage"]["completion_tokens"] == 2
    with LLM(str(folder), device="cpu", max_model_len=256, num_gpu_blocks_override=64,
             generation_config="vllm") as plain:
        assert plain.get_default_sampling_params() == SamplingParams()


@pytest.mark.parametrize("prompts", [["The sky is", "Two plus two"], [[5, 6, 7], [8, 9], [10]]])
def test_a_batch_of_prompts_gets_n_choices_each_in_order(client, llm, prompts):
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)
    reply = api.completions.create(model="tiny-qwen3", prompt=prompts, max_tokens=4, temperature=0.7, seed=5, n=2)
    want = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.7, seed=5, n=2), use_tqdm=False)
    assert [c.index for c in reply.choices] == list(range(2 * len(prompts)))
    assert [c.text for c in reply.choices] == [c.text for out in want for c in out.outputs]
    assert reply.usage.prompt_tokens == sum(len(out.prompt_token_ids) for out in want)
    too_long = client.post("/v1/completions", json={"model": "tiny-qwen3", "prompt": [[5], [6] * 600], "max_tokens": 4})
    assert too_long.status_code == 400 and not llm_engine_busy(client)


def test_a_streamed_batch_gives_each_prompts_choices_their_own_indices(client, llm):
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)
    prompts = ["The sky is", "Two plus two", "Once"]
    texts, usage = {}, None
    for event in api.completions.create(model="tiny-qwen3", prompt=prompts, max_tokens=5, temperature=0.7, seed=5,
                                        n=2, stream=True, stream_options={"include_usage": True}):
        for choice in event.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
        usage = event.usage or usage
    want = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0.7, seed=5, n=2), use_tqdm=False)
    assert [texts[i] for i in range(6)] == [c.text for out in want for c in out.outputs]
    assert usage.prompt_tokens == sum(len(out.prompt_token_ids) for out in want)


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_counts_every_chunk_so_far(client, llm, chat):
    """stream_options.continuous_usage_stats (vLLM's, which guidellm sends to time tokens): every chunk's usage
    holds the prompt and the completion tokens so far, and the last chunk the totals."""
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)
    args = dict(model="tiny-qwen3", max_tokens=6, temperature=0.7, seed=2, n=2, stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True})
    if chat:
        events = api.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **args)
    else:
        events = api.completions.create(prompt="The sky is", **args)
    seen = []
    for event in events:
        seen.append((event.usage.prompt_tokens, event.usage.completion_tokens, bool(event.choices)))
    prompt = seen[-1][0]
    assert all(p == prompt for p, _, _ in seen) and prompt > 0
    counts = [c for _, c, has_choices in seen if has_choices]
    assert counts == sorted(counts) and counts[-1] == seen[-1][1] == 12  # two completions of 6 tokens
    assert counts[0] <= 1  # the counts so far, not the totals given early
    off = api.completions.create(model="tiny-qwen3", prompt="The sky is", max_tokens=3, stream=True,
                                 stream_options={"include_usage": True})
    assert [e.usage is None for e in off][:-1] == [True] * 3  # without it: usage only on the last chunk


def llm_engine_busy(client) -> bool:
    """Whether the engine still runs anything, a moment after the reply (an abort takes effect before its next step)."""
    import time
    for _ in range(200):
        if not client.app.state.engine.engine.has_unfinished():
            return False
        time.sleep(0.01)
    return True


def test_tokenize_detokenize_version_and_ping(client, llm):
    tok = llm.tokenizer
    got = client.post("/tokenize", json={"model": "tiny-qwen3", "prompt": "Hello there", "return_token_strs": True})
    ids = tok.encode("Hello there")
    assert got.json() == {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids,
                          "token_strs": tok.convert_ids_to_tokens(ids)}
    chat = client.post("/tokenize", json={"messages": CHAT}).json()
    plain = client.post("/v1/chat/completions", json=body_for("chat/completions")).json()
    assert chat["count"] == plain["usage"]["prompt_tokens"]  # the prompt a chat completion sees
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": tok.decode(ids)}
    reply = client.post("/detokenize", json={"tokens": [-1]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tokens", reply.text
    both = client.post("/tokenize", json={"prompt": "a", "messages": CHAT})
    assert both.status_code == 400
    assert client.get("/version").json()["version"] and client.get("/ping").status_code == 200


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_spaces_between_special_tokens_reaches_the_tokenizer(client, llm, endpoint):
    """The server passes spaces_between_special_tokens on (it was refused when false): every decode of the
    answer's text asks the tokenizer for it."""
    tokenizer = llm.get_tokenizer()
    decode, asked = tokenizer.decode, []
    tokenizer.decode = lambda ids, **kwargs: asked.append(kwargs) or decode(ids, **kwargs)
    try:
        for spaces in (False, True):
            asked.clear()
            body = {**body_for(endpoint), "max_tokens": 3, "skip_special_tokens": False,
                    "spaces_between_special_tokens": spaces}
            assert client.post(f"/v1/{endpoint}", json=body).status_code == 200
            answers = [a for a in asked if "skip_special_tokens" in a and a["skip_special_tokens"] is False]
            assert answers and all(a.get("spaces_between_special_tokens", True) is spaces for a in answers), asked
    finally:
        del tokenizer.decode


def test_sglang_routers_server_and_model_info(client, llm):
    """sglang-router asks a replica /server_info and /model_info (then SGLang's older /get_...) as it registers it,
    and labels it with the model named there; tried by hand with sglang-router 0.3.2, its /workers then lists the
    replica under model_id "tiny-qwen3" (else "unknown")."""
    infos = [client.get(route).json() for route in ("/server_info", "/model_info", "/get_server_info", "/get_model_info")]
    assert all(info == infos[0] for info in infos)
    info = infos[0]
    assert info["served_model_name"] == "tiny-qwen3" and info["is_generation"] is True
    assert info["architectures"] == ["Qwen3ForCausalLM"] and info["vocab_size"] == llm.model.config.vocab_size
    assert info["max_context_length"] == llm.max_model_len and info["max_running_requests"] == llm.args.max_num_seqs
    assert set(info["eos_token_ids"]) >= {llm.tokenizer.eos_token_id} and info["tp_size"] == 1


def test_vllms_request_id_names_the_response(client):
    for endpoint, prefix in (("completions", "cmpl-"), ("chat/completions", "chatcmpl-")):
        reply = client.post(f"/v1/{endpoint}", json={**body_for(endpoint), "request_id": "abc"}).json()
        assert reply["id"] == f"{prefix}abc"


def test_a_requests_own_chat_template_needs_the_servers_flag_and_is_sandboxed(llm):
    body = {"model": "tiny-qwen3", "max_tokens": 2, "messages": CHAT,
            "chat_template": "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"}
    with TestClient(build_app(llm, "tiny-qwen3")) as plain:
        refused = plain.post("/v1/chat/completions", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
    with TestClient(build_app(llm, "tiny-qwen3", trust_request_chat_template=True)) as trusting:
        reply = trusting.post("/v1/chat/completions", json=body)
        assert reply.json()["usage"]["prompt_tokens"] == len(llm.tokenizer.encode("[Say something.]"))
        escape = trusting.post("/v1/chat/completions", json={**body, "chat_template": "{{ ''.__class__.__mro__ }}"})
        assert escape.status_code == 400 and "template" in escape.json()["error"]["message"], escape.text
