"""The HTTP surface: OpenAI-compatible routes over an EngineLoop.

  POST /v1/chat/completions, /v1/completions -> auth -> parse -> model -> tokens -> submit
       -> JSON body, or SSE chunks `data: {...}` ending with `data: [DONE]`
  GET /v1/models, /health, /metrics
"""

import asyncio
import copy
import hmac
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.sampling_params import SamplingParams
from .engine_loop import EngineLoop, RequestHandle
from .errors import APIError, bad_request, unauthorized, unknown_model
from .metrics import Metrics
from .protocol import DEFAULT_COMPLETION_MAX_TOKENS, ChatCompletionRequest, CompletionRequest, parse
from .responses import DONE, Reply, models_list, sse

DISCONNECT_POLL_S = 0.5
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


@dataclass
class ServerState:
    loop: EngineLoop
    tokenizer: object
    model_name: str
    ctx: int
    metrics: Metrics
    api_key: str | None = None
    on_shutdown: Callable[[], None] | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.encoder = _private_copy(self.tokenizer)

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise unauthorized()

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise unknown_model(name, self.model_name)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        try:
            text = self.encoder.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as err:  # jinja templates raise their own errors for unsupported conversations
            raise bad_request(f"the chat template rejected these messages: {err}", "messages") from None
        return list(self.encoder.encode(text, add_special_tokens=False))

    def completion_prompt(self, prompt: str | list[int]) -> list[int]:
        return prompt if isinstance(prompt, list) else list(self.encoder.encode(prompt, add_special_tokens=True))

    def check_context(self, prompt_ids: list[int], param: str) -> None:
        if len(prompt_ids) >= self.ctx:
            raise bad_request(f"This model's context is {self.ctx} tokens and the prompt has {len(prompt_ids)}; "
                              "shorten the prompt so that it leaves room for output", param,
                              "context_length_exceeded")


class CountStatuses:
    """ASGI middleware: counts responses by endpoint and status for /metrics."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.count_request(endpoint, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)


class EventStream(StreamingResponse):
    """A StreamingResponse that always closes its generator, so a client that goes away
    mid-stream aborts its request at once."""

    def __init__(self, events: AsyncIterator[str]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app):
        state.loop.start()
        try:
            yield
        finally:
            if state.on_shutdown is not None:
                state.on_shutdown()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(CountStatuses, metrics=state.metrics)
    _add_error_handlers(app)
    _add_routes(app, state)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_request, err: APIError):
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, err: StarletteHTTPException):
        return APIError(err.status_code, str(err.detail), "invalid_request_error").response()

    @app.exception_handler(Exception)
    async def internal_error(_request, err: Exception):
        return APIError(500, f"internal error: {type(err).__name__}: {err}", "server_error").response()


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health():
        status = 200 if state.loop.accepting and state.loop.thread.is_alive() else 503
        return JSONResponse({"status": "ok" if status == 200 else "unavailable"}, status_code=status)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        state.authorize(request)
        return models_list(state.model_name, state.created)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        state.authorize(request)
        body = parse(await request.body(), ChatCompletionRequest)
        state.check_model(body.model)
        return await _generate(state, request, body, state.chat_prompt(body.template_messages()), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        state.authorize(request)
        body = parse(await request.body(), CompletionRequest)
        state.check_model(body.model)
        return await _generate(state, request, body, state.completion_prompt(body.single_prompt()), chat=False)


async def _generate(state: ServerState, request: Request, body, prompt_ids: list[int], chat: bool):
    state.check_context(prompt_ids, "messages" if chat else "prompt")
    default_max = state.ctx - len(prompt_ids) if chat else DEFAULT_COMPLETION_MAX_TOKENS
    params: SamplingParams = body.sampling(default_max)
    handle = state.loop.submit(prompt_ids, params)
    reply = Reply(chat, state.model_name)
    if body.stream:
        return EventStream(_events(state.loop, handle, reply, body.include_usage))
    return JSONResponse(await _collect(state.loop, handle, reply, request))


async def _collect(loop: EngineLoop, handle: RequestHandle, reply: Reply, request: Request) -> dict:
    pieces, last = [], None
    watcher = asyncio.create_task(_abort_on_disconnect(loop, handle, request))
    try:
        async for out in handle.outputs():
            pieces.append(out.text_delta)
            last = out
    finally:
        watcher.cancel()
        loop.abort(handle)
    return reply.full("".join(pieces), last)


async def _abort_on_disconnect(loop: EngineLoop, handle: RequestHandle, request: Request) -> None:
    """A non-streaming client that hangs up stops its generation too."""
    while not handle.finished:
        if await request.is_disconnected():
            loop.abort(handle)
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


async def _events(loop: EngineLoop, handle: RequestHandle, reply: Reply, include_usage: bool) -> AsyncIterator[str]:
    last = None
    try:
        if reply.chat:
            yield sse(reply.chunk(None, first=True))
        async for out in handle.outputs():
            last = out
            if out.text_delta:
                yield sse(reply.chunk(out.text_delta))
        yield sse(reply.chunk(None, finish_reason=last.finish_reason))
        if include_usage:
            yield sse(reply.usage_chunk(last))
        yield DONE
    except APIError as err:
        yield sse(err.body())
        yield DONE
    finally:
        loop.abort(handle)


def _private_copy(tokenizer):
    """The engine thread decodes with the tokenizer; the event loop encodes with its own copy,
    since a fast tokenizer must not be used by two threads at once."""
    try:
        return copy.deepcopy(tokenizer)
    except Exception:
        return tokenizer
