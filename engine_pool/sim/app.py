"""The simulated engine's HTTP face: vLLM's OpenAI-compatible routes plus ``/sim/*`` admin routes.

Routes (vLLM's shapes, see ``wire.py`` and ``wire_apis.py``):
    POST /v1/chat/completions, /v1/completions   streaming and not; ``X-Request-Id`` is the id
    POST /v1/responses, /v1/messages              streaming (typed SSE events) and not
    POST /v1/embeddings, /pooling, /v1/score, /score, /v1/rerank, /rerank, /v2/rerank
                           a prefill of the largest sequence (one engine step), then the answer
    POST /detokenize       ``{"prompt": text}`` of the token ids (special tokens included)
    POST /v1/audio/transcriptions, /v1/audio/translations   multipart; a fixed audio prefill of
                           AUDIO_PROMPT_TOKENS (Whisper's 30 s window is 1500 encoder frames)
                           and AUDIO_OUTPUT_TOKENS of text: ``{"text": ...}``
    GET  /version
    GET  /v1/models        GET /health (200, or 503 when dead)
    POST /tokenize         GET /metrics (vLLM names, simulated seconds)
    GET  /sim/requests[?request_id=]   what the engine saw of each request (records.py)
    GET  /sim/state        scheduler snapshot and simulated clock
    GET  /sim/faults       POST /sim/faults  (a FaultSpec as JSON; ``{}`` clears)

Errors are vLLM's (Anthropic-shaped on /v1/messages): 400 ``BadRequestError`` (with ``param``;
``input_tokens`` when prompt plus max_tokens exceed ``max_model_len``), 404 ``NotFoundError``
for an unknown model. ``hang`` is a
pure ASGI middleware (it must not answer at all); the other faults live in ``serving.py``.
FastAPI is allowed here because this is the simulator, not the gateway.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.types import ASGIApp, Receive, Scope, Send

from engine_pool.engine_api import Endpoint
from engine_pool.sim import wire, wire_apis
from engine_pool.sim.counting import PromptCounter, RequestRejected, SimRequest
from engine_pool.sim.engine import RequestStream, SimEngine
from engine_pool.sim.faults import FaultError, FaultSpec, FaultState
from engine_pool.sim.metrics import CountRequests
from engine_pool.sim.profile import EngineProfile
from engine_pool.sim.serving import (
    EngineStreamingResponse,
    FinishReason,
    GenerateEndpoint,
    Generation,
    full_body,
    race_disconnect,
    stream_body,
)

SIM_VERSION = "0.33.0+sim"
AUDIO_PROMPT_TOKENS = 1500
AUDIO_OUTPUT_TOKENS = 16
STORED_RESPONSES = 10_000
ID_PREFIX = {
    "chat": "chatcmpl-",
    "completions": "cmpl-",
    "responses": "resp_",
    "messages": "chatcmpl-",
}
# The sim's own routes beyond the generating ones, as vLLM serves them (the gateway's table,
# gateway/request/routes.py, forwards each of these paths unchanged).
POOLING_PATHS: dict[str, Endpoint] = {
    "/v1/embeddings": "embeddings",
    "/pooling": "pooling",
    "/v1/score": "score",
    "/score": "score",
    "/v1/rerank": "rerank",
    "/rerank": "rerank",
    "/v2/rerank": "rerank",
}
AUDIO_PATHS: dict[str, Endpoint] = {
    "/v1/audio/transcriptions": "transcriptions",
    "/v1/audio/translations": "translations",
}

ApplyFaults = Callable[[FaultSpec], Awaitable[None]]
DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."


@dataclass(frozen=True, slots=True)
class SimParts:
    profile: EngineProfile
    engine: SimEngine
    faults: FaultState
    counter: PromptCounter
    # Responses this engine stored (vLLM keeps them in its own memory): a follow-up naming one
    # it does not hold is answered 404, as vLLM does. The most recent STORED_RESPONSES are kept.
    stored: OrderedDict[str, None] = field(default_factory=OrderedDict)


def _error(
    status: int,
    message: str,
    type_: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    *,
    endpoint: Endpoint | None = None,
) -> JSONResponse:
    if endpoint == "messages":  # vLLM's Anthropic server answers in Anthropic's error shape
        body = wire_apis.anthropic_error_body(message, status)
        return JSONResponse(body, status, headers=headers)
    return JSONResponse(wire.error_body(message, type_, status, param), status, headers=headers)


class HangMiddleware:
    """With the ``hang`` fault on, read the request and never answer (admin routes excepted)."""

    def __init__(self, app: ASGIApp, faults: FaultState) -> None:
        self.app = app
        self.faults = faults

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and self.faults.spec.hang
            and not scope["path"].startswith("/sim/")
        ):
            self.faults.injected["hang"] += 1
            while (await receive())["type"] != "http.disconnect":
                pass  # drain the body; answer nothing until the client gives up
            return
        await self.app(scope, receive, send)


def _output(
    parts: SimParts, endpoint: GenerateEndpoint, max_tokens: int | None, prompt_tokens: int
) -> tuple[int, FinishReason]:
    """Output tokens and finish reason: max_tokens exactly (ignore_eos-like), else a default."""
    out = parts.profile.output
    if max_tokens is not None:
        return max_tokens, "length"
    if endpoint == "completions":  # vLLM's CompletionRequest.max_tokens defaults to 16
        return out.completions_default_tokens, "length"
    return min(out.default_tokens, parts.profile.max_model_len - prompt_tokens), "stop"


async def _validate(parts: SimParts, endpoint: Endpoint, body: bytes) -> Response | SimRequest:
    """Parse as vLLM does and roll the fault dice: an error response, or the request."""
    profile, faults = parts.profile, parts.faults
    try:
        routed = parts.counter.read(endpoint, body)
    except RequestRejected as exc:
        return _error(400, exc.message, "BadRequestError", exc.param, endpoint=endpoint)
    if routed.model not in profile.served_names:
        message = f"The model `{routed.model}` does not exist."
        return _error(404, message, "NotFoundError", "model", endpoint=endpoint)
    if faults.spec.dead or parts.engine.failed:
        return _error(500, DEAD_MESSAGE, "InternalServerError", endpoint=endpoint)
    injected = faults.draw_error()
    if injected == 500:
        return _error(500, "injected fault: internal server error", "InternalServerError")
    if injected == 429:
        return _error(
            429, "injected fault: too many requests", "RateLimitError", headers={"retry-after": "1"}
        )
    return routed


async def _prepare(
    parts: SimParts, request: Request, endpoint: GenerateEndpoint
) -> Response | tuple[Generation, bool]:
    """Validate as vLLM does (and roll the fault dice): an error response, or what to generate."""
    profile = parts.profile
    body = await request.body()
    routed = await _validate(parts, endpoint, body)
    if isinstance(routed, Response):
        return routed
    if routed.prompts > 1:
        return _error(
            400, "the simulator serves one prompt per request", "BadRequestError", "prompt"
        )
    # Off the event loop: a 300k-token prompt must not stall every other stream.
    prompt_tokens = await asyncio.to_thread(parts.counter.count, routed)
    requested = routed.max_tokens or 0
    if prompt_tokens + requested > profile.max_model_len or prompt_tokens >= profile.max_model_len:
        message = wire.context_too_long_message(profile.max_model_len, requested, prompt_tokens)
        return _error(400, message, "BadRequestError", "input_tokens", endpoint=endpoint)
    previous = routed.previous_response_id
    if previous is not None and previous not in parts.stored:
        message = f"Response with id '{previous}' not found."
        return _error(404, message, "invalid_request_error", "previous_response_id")
    output_tokens, finish = _output(parts, endpoint, routed.max_tokens, prompt_tokens)
    request_id = request.headers.get("x-request-id") or wire.random_id()
    gen = Generation(
        endpoint=endpoint,
        request_id=request_id,
        response_id=ID_PREFIX[endpoint] + request_id,
        created=int(time.time()),
        model=profile.model,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        finish_reason=finish,
        include_usage=routed.include_usage,
        request=orjson.loads(body) if endpoint == "responses" else {},
    )
    if endpoint == "responses" and gen.request.get("store", True) is not False:
        parts.stored[gen.response_id] = None
        while len(parts.stored) > STORED_RESPONSES:
            parts.stored.popitem(last=False)
    return gen, routed.stream


async def _generate(parts: SimParts, request: Request, endpoint: GenerateEndpoint) -> Response:
    prepared = await _prepare(parts, request, endpoint)
    if isinstance(prepared, Response):
        return prepared
    gen, streaming = prepared
    engine, faults = parts.engine, parts.faults
    stream = engine.submit(
        gen.request_id,
        endpoint=endpoint,
        prompt_tokens=gen.prompt_tokens,
        output_tokens=gen.output_tokens,
    )
    handed_off = False
    try:
        delay = faults.spec.first_byte_delay_s
        if delay > 0:
            faults.injected["first_byte_delay"] += 1
            stayed, _ = await race_disconnect(request.receive, asyncio.sleep(delay))
            if not stayed:
                return Response(status_code=499)
        if streaming:
            handed_off = True  # from here the response aborts the request however it ends
            return EngineStreamingResponse(
                stream_body(gen, engine, stream, faults), on_close=lambda: engine.abort(stream.key)
            )
        stayed, body = await race_disconnect(request.receive, full_body(gen, stream))
        return JSONResponse(body) if stayed else Response(status_code=499)
    finally:
        if not handed_off:
            engine.abort(stream.key)  # a no-op once finished; frees the seat if abandoned


def create_app(parts: SimParts, apply_faults: ApplyFaults) -> FastAPI:
    """The ASGI app of one simulated engine; ``apply_faults`` may crash or restart the server."""
    profile, engine, faults = parts.profile, parts.engine, parts.faults
    app = FastAPI(title=f"shapegate sim ({profile.name})", openapi_url=None, docs_url=None)
    app.add_middleware(HangMiddleware, faults=faults)
    app.add_middleware(CountRequests, metrics=engine.metrics)  # outermost: refusals count too

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _generate(parts, request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(parts, request, "completions")

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await _generate(parts, request, "responses")

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await _generate(parts, request, "messages")

    for path, endpoint in POOLING_PATHS.items():
        app.add_api_route(path, _pool_handler(parts, endpoint), methods=["POST"])

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        routed = await _validate(parts, "detokenize", await request.body())
        if isinstance(routed, Response):
            return routed
        try:
            text = await asyncio.to_thread(parts.counter.detokenize, routed)
        except RequestRejected as exc:
            return _error(400, exc.message, "BadRequestError", exc.param)
        return JSONResponse({"prompt": text})

    for path, endpoint in AUDIO_PATHS.items():
        app.add_api_route(path, _audio_handler(parts, endpoint), methods=["POST"])

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": SIM_VERSION})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(wire.model_list(profile.served_names, profile.max_model_len))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if faults.spec.dead or engine.failed else 200)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        try:
            data = orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:
            return _error(400, f"request body is not valid JSON: {exc}", "BadRequestError")
        tokens = await asyncio.to_thread(parts.counter.tokenize, data)
        if tokens is None:
            return _error(
                400, "give 'prompt' (text or token ids) or 'messages'", "BadRequestError", "prompt"
            )
        return JSONResponse(wire.tokenize_response(tokens, profile.max_model_len))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(engine.snapshot()), media_type=CONTENT_TYPE_LATEST)

    @app.get("/sim/requests")
    async def requests(request_id: str | None = None) -> JSONResponse:
        found = engine.requests.find(request_id)
        return JSONResponse({"requests": [r.as_dict() for r in found]})

    @app.get("/sim/state")
    async def state() -> JSONResponse:
        snap = engine.snapshot()
        return JSONResponse(
            {
                "profile": profile.name,
                "clock_s": engine.now(),
                "time_scale": engine.time_scale,
                "running": snap.running,
                "waiting": snap.waiting,
                "kv_used_tokens": snap.kv_used_tokens,
                "kv_usage": snap.kv_usage,
                "failed": engine.failed,
            }
        )

    @app.get("/sim/faults")
    async def get_faults() -> JSONResponse:
        return JSONResponse(faults.as_dict())

    @app.post("/sim/faults")
    async def set_faults(request: Request) -> JSONResponse:
        try:
            spec = FaultSpec.parse(orjson.loads(await request.body() or b"{}"))
        except (orjson.JSONDecodeError, FaultError) as exc:
            return _error(400, str(exc), "BadRequestError", "faults")
        # Applied after this response is sent: a crash cuts every connection, this one too.
        return JSONResponse(
            {"faults": spec.model_dump(exclude_defaults=True)},
            background=BackgroundTask(apply_faults, spec),
        )

    return app


def _pool_handler(parts: SimParts, endpoint: Endpoint) -> Callable[[Request], Awaitable[Response]]:
    async def handle(request: Request) -> Response:
        return await _pool(parts, request, endpoint)

    return handle


async def _pool(parts: SimParts, request: Request, endpoint: Endpoint) -> Response:
    """Embeddings, pooling, score, rerank: a prefill of the largest sequence (one engine step
    of one output token stands for it), then vectors or scores derived from the texts."""
    body = await request.body()
    routed = await _validate(parts, endpoint, body)
    if isinstance(routed, Response):
        return routed
    profile, engine = parts.profile, parts.engine
    prompt_tokens = await asyncio.to_thread(parts.counter.count, routed)
    if prompt_tokens >= profile.max_model_len:
        message = wire.context_too_long_message(profile.max_model_len, 0, prompt_tokens)
        return _error(400, message, "BadRequestError", "input_tokens")
    request_id = request.headers.get("x-request-id") or wire.random_id()
    stream = engine.submit(
        request_id, endpoint=endpoint, prompt_tokens=max(prompt_tokens, 1), output_tokens=1
    )
    try:
        stayed, _ = await race_disconnect(request.receive, _drain(stream))
    finally:
        engine.abort(stream.key)
    if not stayed:
        return Response(status_code=499)
    data = orjson.loads(body)
    texts = await asyncio.to_thread(parts.counter.pooled, routed)
    created, model = int(time.time()), profile.model
    if endpoint == "embeddings":
        encoding = str(data.get("encoding_format") or "float")
        payload = wire_apis.embeddings_body(
            f"embd-{request_id}", created, model, texts, prompt_tokens, encoding
        )
    elif endpoint == "pooling":
        payload = wire_apis.pooling_body(f"pool-{request_id}", created, model, texts, prompt_tokens)
    elif endpoint == "score":
        payload = wire_apis.score_body(f"score-{request_id}", created, model, texts, prompt_tokens)
    else:
        documents = [
            d.get("text", "") if isinstance(d, dict) else str(d) for d in data["documents"]
        ]
        top_n = data.get("top_n") if isinstance(data.get("top_n"), int) else None
        payload = wire_apis.rerank_body(
            f"rerank-{request_id}", model, documents, texts, prompt_tokens, top_n
        )
    return JSONResponse(payload)


async def _drain(stream: RequestStream) -> None:
    last = False
    while not last:
        _, _, last = await stream.next_tokens()


def _audio_handler(parts: SimParts, endpoint: Endpoint) -> Callable[[Request], Awaitable[Response]]:
    async def handle(request: Request) -> Response:
        content_type = request.headers.get("content-type", "").encode()
        try:
            routed = parts.counter.read_form(endpoint, content_type, await request.body())
        except RequestRejected as exc:
            return _error(400, exc.message, "BadRequestError", exc.param)
        if routed.model not in parts.profile.served_names:
            message = f"The model `{routed.model}` does not exist."
            return _error(404, message, "NotFoundError", "model")
        request_id = request.headers.get("x-request-id") or wire.random_id()
        stream = parts.engine.submit(
            request_id,
            endpoint=endpoint,
            prompt_tokens=AUDIO_PROMPT_TOKENS,
            output_tokens=AUDIO_OUTPUT_TOKENS,
        )
        try:
            stayed, _ = await race_disconnect(request.receive, _drain(stream))
        finally:
            parts.engine.abort(stream.key)
        if not stayed:
            return Response(status_code=499)
        return JSONResponse({"text": wire.output_text(0, AUDIO_OUTPUT_TOKENS).strip()})

    return handle
