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
    GET  /v1/models        GET /health (200 while the server answers; vLLM exits when dead)
    POST /tokenize         GET /metrics (vLLM names, simulated seconds)
    GET  /sim/requests[?request_id=]   what the engine saw of each request (records.py)
    GET  /sim/state        scheduler snapshot and simulated clock
    GET  /sim/faults       POST /sim/faults  (a FaultSpec as JSON; ``{}`` clears)

Only the routes of the profile's ``tasks`` exist (a generate-only model 404s the pooling and
audio routes with ``{"detail": "Not Found"}``, as vLLM does). The generating routes live in
``generation.py`` (vLLM 0.32's rules: ``vllm_rules.py``), what every route shares in
``handling.py``. Errors are vLLM's (Anthropic-shaped on /v1/messages):
400 ``BadRequestError`` (with ``param``; ``input_tokens`` when prompt plus max_tokens exceed
``max_model_len``), 404 ``NotFoundError`` for an unknown model. ``hang`` is a
pure ASGI middleware (it must not answer at all); the other faults live in ``serving.py``.
FastAPI is allowed here because this is the simulator, not the gateway.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.types import ASGIApp, Receive, Scope, Send

from engine_pool.engine_api import RouteKind
from engine_pool.sim import vllm_rules, wire, wire_apis
from engine_pool.sim.counting import RequestRejected
from engine_pool.sim.engine import RequestStream
from engine_pool.sim.faults import FaultError, FaultSpec, FaultState
from engine_pool.sim.generation import GENERATE_PATHS, generate_handler
from engine_pool.sim.handling import SimParts
from engine_pool.sim.handling import error as _error
from engine_pool.sim.handling import validate as _validate
from engine_pool.sim.metrics import CountRequests
from engine_pool.sim.serving import race_disconnect

SIM_VERSION = "0.33.0+sim"
AUDIO_PROMPT_TOKENS = 1500
AUDIO_OUTPUT_TOKENS = 16
# The sim's own routes beyond the generating ones, as vLLM serves them (the gateway's table,
# gateway/protocols/routes.py, forwards each of these paths unchanged).
POOLING_PATHS: dict[str, RouteKind] = {
    "/v1/embeddings": "embeddings",
    "/pooling": "pooling",
    "/v1/score": "score",
    "/score": "score",
    "/v1/rerank": "rerank",
    "/rerank": "rerank",
    "/v2/rerank": "rerank",
}
AUDIO_PATHS: dict[str, RouteKind] = {
    "/v1/audio/transcriptions": "transcriptions",
    "/v1/audio/translations": "translations",
}

ApplyFaults = Callable[[FaultSpec], Awaitable[None]]


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


def create_app(parts: SimParts, apply_faults: ApplyFaults) -> FastAPI:
    """The ASGI app of one simulated engine; ``apply_faults`` may crash or restart the server."""
    profile, engine, faults = parts.profile, parts.engine, parts.faults
    app = FastAPI(title=f"shapegate sim ({profile.name})", openapi_url=None, docs_url=None)
    app.add_middleware(HangMiddleware, faults=faults)
    app.add_middleware(CountRequests, metrics=engine.metrics)  # outermost: refusals count too

    # vLLM registers only the routes of the tasks its model serves: the others answer
    # FastAPI's own 404 {"detail": "Not Found"}.
    if "generate" in profile.tasks:
        for path, generating in GENERATE_PATHS.items():
            app.add_api_route(path, generate_handler(parts, generating), methods=["POST"])
    for path, kind in POOLING_PATHS.items():
        if vllm_rules.TASK_OF[kind] in profile.tasks:
            app.add_api_route(path, _pool_handler(parts, kind), methods=["POST"])

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

    if "transcription" in profile.tasks:
        for path, kind in AUDIO_PATHS.items():
            app.add_api_route(path, _audio_handler(parts, kind), methods=["POST"])

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": SIM_VERSION})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(wire.model_list(profile.served_names, profile.max_model_len))

    @app.get("/health")
    async def health() -> Response:
        # 200 while the server answers at all: after an engine-core death vLLM's server exits
        # within ~0.5 s, before its health route ever reports the death.
        return Response(status_code=200)

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


def _pool_handler(parts: SimParts, kind: RouteKind) -> Callable[[Request], Awaitable[Response]]:
    async def handle(request: Request) -> Response:
        return await _pool(parts, request, kind)

    return handle


async def _pool(parts: SimParts, request: Request, kind: RouteKind) -> Response:
    """Embeddings, pooling, score, rerank: a prefill of the largest sequence (one engine step
    of one output token stands for it), then vectors or scores derived from the texts."""
    body = await request.body()
    routed = await _validate(parts, kind, body)
    if isinstance(routed, Response):
        return routed
    profile, engine = parts.profile, parts.engine
    prompt_tokens = await asyncio.to_thread(parts.counter.count, routed)
    if prompt_tokens > profile.max_model_len:  # pooling keeps the whole context for input
        message = wire.context_too_long_message(profile.max_model_len, prompt_tokens)
        return _error(400, message, "BadRequestError", "input_tokens")
    request_id = request.headers.get("x-request-id") or wire.random_id()
    stream = engine.submit(
        request_id, route=kind, prompt_tokens=max(prompt_tokens, 1), output_tokens=1
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
    if kind == "embeddings":
        encoding = str(data.get("encoding_format") or "float")
        payload = wire_apis.embeddings_body(
            f"embd-{request_id}", created, model, texts, prompt_tokens, encoding
        )
    elif kind == "pooling":
        payload = wire_apis.pooling_body(f"pool-{request_id}", created, model, texts, prompt_tokens)
    elif kind == "score":
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


def _audio_handler(parts: SimParts, kind: RouteKind) -> Callable[[Request], Awaitable[Response]]:
    async def handle(request: Request) -> Response:
        content_type = request.headers.get("content-type", "").encode()
        try:
            routed = parts.counter.read_form(kind, content_type, await request.body())
        except RequestRejected as exc:
            return _error(400, exc.message, "BadRequestError", exc.param)
        if routed.model not in parts.profile.served_names:
            message = f"The model `{routed.model}` does not exist."
            return _error(404, message, "NotFoundError", "model")
        request_id = request.headers.get("x-request-id") or wire.random_id()
        stream = parts.engine.submit(
            request_id,
            route=kind,
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
