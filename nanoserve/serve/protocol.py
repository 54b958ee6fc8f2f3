"""OpenAI's request and response shapes, and the pure functions between them and the engine.

Nothing here touches the engine or the network: requests are checked and turned into SamplingParams,
engine outputs are turned into response JSON, and server-sent events are formatted. That keeps the
rules in one place, where they are easy to read and to test.
"""
import json
import time
import uuid

from pydantic import BaseModel, ConfigDict

from nanoserve.engine.sampling_params import SamplingParams


class BadRequest(ValueError):
    """A request the server will not run: HTTP 400, naming the parameter at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error_body(message: str, type_: str, status: int, param: str | None = None) -> dict:
    """OpenAI's error JSON, which its client turns into BadRequestError, RateLimitError, ..."""
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def sse(data: dict | str) -> str:
    """One server-sent event: a `data:` line and a blank line. The stream ends with sse("[DONE]")."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """The fields both endpoints share. Unknown fields are ignored, as OpenAI-compatible servers do."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # not OpenAI's: pass it with the client's extra_body
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False  # not OpenAI's: benchmarks want exactly max_tokens tokens
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[int]
    logprobs: int | None = None  # legacy completions: the number of top log-probs per token


class ChatMessage(BaseModel):
    role: str
    content: str | list[dict]  # a string, or a list of {"type": "text", "text": ...} parts


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None


def message_text(message: ChatMessage) -> str:
    if isinstance(message.content, str):
        return message.content
    parts = []
    for part in message.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise BadRequest("only text content parts are supported", "messages")
        parts.append(part["text"])
    return "".join(parts)


def sampling_params(request: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                    default_max_tokens: int) -> SamplingParams:
    """The request's SamplingParams; a bad value raises BadRequest naming its parameter."""
    if request.stream_options is not None and not request.stream:
        raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
    fields = dict(temperature=request.temperature, top_p=request.top_p, top_k=request.top_k, n=request.n,
                  seed=request.seed, stop=request.stop, ignore_eos=request.ignore_eos,
                  max_tokens=default_max_tokens if max_tokens is None else max_tokens, logprobs=logprobs)
    try:
        return SamplingParams(**fields)
    except ValueError as e:  # "SamplingParams: top_p must be in (0, 1], got 2.0"
        message = str(e).removeprefix("SamplingParams: ")
        param = next((name for name in fields if message.startswith(name + " ")), None)
        raise BadRequest(message, param) from None


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def completion_logprobs(tokenizer, token_ids: list[int], steps: list[dict], text_offset: int = 0) -> dict:
    """The legacy completions' logprobs: tokens, their log-probs, the top ones of each step, text offsets."""
    tokens = [tokenizer.decode([t]) for t in token_ids]
    offsets, at = [], text_offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {"tokens": tokens, "token_logprobs": [float(lp[t]) for t, lp in zip(token_ids, steps)],
            "top_logprobs": [{tokenizer.decode([k]): float(v) for k, v in lp.items()} for lp in steps],
            "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: list[int], steps: list[dict], top: int) -> dict:
    """The chat endpoint's logprobs: per token its text, log-prob, UTF-8 bytes and the top alternatives."""
    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": float(logprob), "bytes": list(text.encode())}

    content = []
    for t, lp in zip(token_ids, steps):
        alternatives = sorted(lp.items(), key=lambda kv: -kv[1])[:top]
        content.append({**entry(t, lp[t]), "top_logprobs": [entry(k, v) for k, v in alternatives]})
    return {"content": content}


def completion_response(request_id: str, model: str, choices: list[dict], prompt_tokens: int,
                        completion_tokens: int) -> dict:
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}


def chat_response(request_id: str, model: str, choices: list[dict], prompt_tokens: int,
                  completion_tokens: int) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}


def chunk(request_id: str, model: str, chat: bool, choices: list[dict], usage_: dict | None = None,
          include_usage: bool = False) -> dict:
    """One streamed chunk. With include_usage every chunk carries "usage": null, and the last one, with
    no choices, the totals."""
    body = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices}
    if include_usage:
        body["usage"] = usage_
    return body
