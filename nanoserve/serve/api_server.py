"""An OpenAI-compatible HTTP server over the async engine (FastAPI + uvicorn), like `vllm serve`.

    GET  /health               200 while the engine loop runs
    GET  /metrics              Prometheus text (nanoserve:num_requests_running, ...)
    GET  /v1/models            the one model served
    POST /v1/completions       a prompt (text or token ids) -> text; stream: true for server-sent events
    POST /v1/chat/completions  messages, through the model's chat template -> a message

Faults: a bad request gets HTTP 400 with OpenAI's error JSON and changes nothing else; a full server
gets 503; a client that goes away mid-stream aborts its request. SIGINT/SIGTERM: the listener closes,
requests in flight end with a final error event, and the process exits 0.
"""
import asyncio
import signal
from contextlib import asynccontextmanager

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanoserve.serve.async_engine import AsyncEngine, EngineStopped, QueueFull, RequestStream
from nanoserve.serve.metrics import ServerMetrics
from nanoserve.serve.protocol import (BadRequest, ChatCompletionRequest, CompletionRequest, chat_logprobs,
                                      chat_response, chunk, completion_logprobs, completion_response, error_body,
                                      message_text, new_id, sampling_params, sse, usage)


class ModelNotFound(LookupError):
    pass


class Unauthorized(PermissionError):
    pass


def build_app(llm, model_name: str, max_waiting_requests: int = 256, api_key: str | None = None) -> FastAPI:
    """The app for one loaded LLM. Its AsyncEngine starts with the server's event loop (lifespan)."""
    metrics = ServerMetrics(model_name)
    tokenizer = llm.tokenizer

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.engine = AsyncEngine(llm, max_waiting_requests, metrics)
        yield
        await app.state.engine.close()

    app = FastAPI(title="nanoserve", lifespan=lifespan)

    # Errors, all in OpenAI's shape.
    def error(status: int, type_: str, message: str, param: str | None = None) -> JSONResponse:
        return JSONResponse(error_body(message, type_, status, param), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_, exc: RequestValidationError):
        first = exc.errors()[0]
        fields = [str(p) for p in first["loc"] if p != "body"]
        param = fields[0] if fields else None  # the request's field (deeper parts name pydantic's union types)
        return error(400, "invalid_request_error", f"{param}: {first['msg']}", param)

    @app.exception_handler(BadRequest)
    async def on_bad_request(_, exc: BadRequest):
        return error(400, "invalid_request_error", str(exc), exc.param)

    @app.exception_handler(ModelNotFound)
    async def on_unknown_model(_, exc: ModelNotFound):
        return error(404, "invalid_request_error", str(exc), "model")

    @app.exception_handler(QueueFull)
    @app.exception_handler(EngineStopped)
    async def on_unavailable(_, exc: Exception):
        return error(503, "service_unavailable_error", str(exc))

    @app.exception_handler(Unauthorized)
    async def on_unauthorized(_, exc: Unauthorized):
        return error(401, "authentication_error", str(exc))

    async def check_api_key(request: Request) -> None:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise Unauthorized("invalid or missing API key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])  # the routes an API key guards

    # Helpers shared by the two generation endpoints.
    def engine(request: Request) -> AsyncEngine:
        return request.app.state.engine

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ModelNotFound(f"model {name!r} is not served here; this server serves {model_name!r}")

    async def start(request: Request, prompt_ids: list[int], params, stream_text: bool) -> RequestStream:
        try:
            return await engine(request).add_request(prompt_ids, params, stream_text)
        except ValueError as e:  # the engine's own checks: a prompt too long for max_model_len, ...
            raise BadRequest(str(e), "prompt") from None

    async def wait_for_all(stream: RequestStream, request: Request) -> None:
        """Wait for a request that is not streamed; if its client goes away meanwhile, abort it. (A stream
        notices a missing client when it writes the next chunk; this response writes nothing until the end.)"""
        async def drain():
            async for _ in stream:
                pass

        done = asyncio.ensure_future(drain())
        try:
            while not done.done():
                await asyncio.wait({done}, timeout=0.5)
                if not done.done() and await request.is_disconnected():
                    done.cancel()
            await done
        finally:
            stream.abort()  # finished: nothing to do; otherwise nothing more is computed for it

    async def events(stream: RequestStream, request_id: str, chat: bool, include_usage: bool):
        """The server-sent events of one streamed request, ending in `data: [DONE]`."""
        params, counts = stream.params, [0] * stream.params.n
        top = params.logprobs or 0
        tail = None
        try:
            if chat:  # the first chunk of each choice names the role, as OpenAI's does
                yield sse(chunk(request_id, model_name, True,
                                [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None} for i in range(params.n)], None, include_usage))
            async for delta in stream:
                counts[delta.index] += 1
                choice = {"index": delta.index, "finish_reason": delta.finish_reason, "logprobs": None}
                if chat:
                    choice["delta"] = {"content": delta.text}
                    if delta.logprobs is not None:
                        choice["logprobs"] = chat_logprobs(tokenizer, [delta.token_id], [delta.logprobs], top)
                else:
                    choice["text"] = delta.text
                    if delta.logprobs is not None:
                        choice["logprobs"] = completion_logprobs(tokenizer, [delta.token_id], [delta.logprobs])
                yield sse(chunk(request_id, model_name, chat, [choice], None, include_usage))
            if include_usage:
                yield sse(chunk(request_id, model_name, chat, [], usage(len(stream.prompt_ids), sum(counts)), True))
        except (EngineStopped, RuntimeError) as e:  # the server is stopping, or a step failed
            tail = error_body(str(e), "server_error", 503 if isinstance(e, EngineStopped) else 500)
        finally:
            stream.abort()  # a client that went away lands here (GeneratorExit): its blocks are freed
        if tail is not None:
            yield sse(tail)
        yield sse("[DONE]")

    def streaming(body) -> StreamingResponse:
        return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    # The endpoints.
    @app.get("/health")
    async def health(request: Request):
        return Response(status_code=200 if engine(request).alive else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                           "owned_by": "nanoserve", "max_model_len": llm.max_model_len}]}

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        if isinstance(body.prompt, str):
            prompt_ids = tokenizer.encode(body.prompt)
        else:
            prompt_ids = body.prompt
        params = sampling_params(body, body.max_tokens, body.logprobs, default_max_tokens=16)
        stream = await start(request, prompt_ids, params, stream_text=body.stream)
        request_id = new_id("cmpl")
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return streaming(events(stream, request_id, False, include_usage))
        await wait_for_all(stream, request)
        choices = []
        for seq in sorted(stream.seqs, key=lambda s: s.index):
            out = seq.completion()
            logprobs = completion_logprobs(tokenizer, out.token_ids, seq.logprobs) if seq.logprobs is not None else None
            choices.append({"index": seq.index, "text": out.text, "logprobs": logprobs,
                            "finish_reason": out.finish_reason})
        generated = sum(len(s.output_ids) for s in stream.seqs)
        return completion_response(request_id, model_name, choices, len(prompt_ids), generated)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        if not body.messages:
            raise BadRequest("messages must not be empty", "messages")
        conversation = [{"role": m.role, "content": message_text(m)} for m in body.messages]
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                            enable_thinking=False)
        prompt_ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        top = body.top_logprobs or 0
        if body.top_logprobs is not None and not body.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = sampling_params(body, max_tokens, top if body.logprobs else None,
                                 default_max_tokens=max(llm.max_model_len - len(prompt_ids), 1))
        stream = await start(request, prompt_ids, params, stream_text=body.stream)
        request_id = new_id("chatcmpl")
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return streaming(events(stream, request_id, True, include_usage))
        await wait_for_all(stream, request)
        choices = []
        for seq in sorted(stream.seqs, key=lambda s: s.index):
            out = seq.completion()
            logprobs = chat_logprobs(tokenizer, out.token_ids, seq.logprobs, top) if seq.logprobs is not None else None
            choices.append({"index": seq.index, "message": {"role": "assistant", "content": out.text},
                            "logprobs": logprobs, "finish_reason": out.finish_reason})
        generated = sum(len(s.output_ids) for s in stream.seqs)
        return chat_response(request_id, model_name, choices, len(prompt_ids), generated)

    app.include_router(v1)
    return app


class Server(uvicorn.Server):
    """uvicorn's server, with our ending for SIGINT/SIGTERM: stop the engine (requests in flight get a
    final error event), let uvicorn close the connections, and return normally. (uvicorn itself would
    raise the signal again after shutting down, and the process would die of it instead of exiting 0.)"""

    def __init__(self, config: uvicorn.Config, app: FastAPI):
        super().__init__(config)
        self.app = app

    def handle_exit(self, sig: int, frame) -> None:
        engine = getattr(self.app.state, "engine", None)
        if engine is not None:  # we are in a signal handler: hand the stop to the event loop
            engine.loop_task.get_loop().call_soon_threadsafe(engine.stop)
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting for connections
        else:
            self.should_exit = True


def serve(llm, model_name: str, host: str = "127.0.0.1", port: int = 8000, max_waiting_requests: int = 256,
          api_key: str | None = None) -> None:
    """Serve until SIGINT or SIGTERM."""
    app = build_app(llm, model_name, max_waiting_requests, api_key)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
    print(f"nanoserve: serving {model_name} on http://{host}:{port} (Ctrl-C to stop)", flush=True)
    asyncio.run(Server(config, app).serve())
