"""Serving one generation request: from a parsed request to vLLM's bytes, with faults applied.

Contract:
- ``Generation`` is everything the handler decided (ids, token counts, finish reason).
- ``stream_body(gen, engine, stream, faults)`` yields SSE events as the engine produces tokens,
  framed by the route (``framer``): chat and completions one chunk per token (chat starts with
  the role chunk), the usage chunk when asked, then ``[DONE]``; Responses and Anthropic
  Messages their typed events (``wire_apis.py``), one delta per token. Whatever ends it (done,
  client gone, crash), its ``finally`` aborts the request in the engine, which frees its seat
  and KV at once.
- ``stream_batch_body(gens, engine, streams, faults)``: a completions batch, one ``Generation``
  and engine request per prompt, their chunks interleaved as the engine produces them (each
  with its prompt's ``index``), then one usage chunk of the sums when asked.
- Continuous usage (``Generation.continuous_usage``): every chunk carries the usage so far.
- An engine-core death (``EngineCrashed`` with reason ``engine_dead``) ends a stream with the
  route's error event (then ``[DONE]`` on chat and completions), as vLLM does; a crash (the
  process is gone) cuts the connection.
- ``full_body(gen, stream)`` waits for the last token and returns the JSON body;
  ``full_batch_body(gens, streams)`` the same for a completions batch (one choice a prompt).
- ``race_disconnect(receive, coro)`` runs ``coro`` until it finishes or the client disconnects
  (vLLM's ``with_cancellation``): a non-streaming handler is otherwise never cancelled.
- Faults: ``stall_after_tokens`` pauses a stream, ``drop_after_chunks`` (every SSE event counts,
  ``[DONE]`` included) raises ``DroppedConnection``, which makes the server cut the TCP
  connection mid-body; a crashed engine does the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from engine_pool.sim import wire, wire_apis
from engine_pool.sim.engine import EngineCrashed, RequestStream, SimEngine
from engine_pool.sim.faults import FaultState

T = TypeVar("T")
FinishReason = Literal["length", "stop"]
GenerateRouteKind = Literal["chat", "completions", "responses", "messages"]


class DroppedConnection(ConnectionResetError):
    """Raised inside a response to make the server cut the connection (a fault, not a bug)."""


@dataclass(frozen=True, slots=True)
class Generation:
    route: GenerateRouteKind
    request_id: str
    response_id: str
    created: int
    model: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: FinishReason
    include_usage: bool
    # The request body's fields a Responses answer echoes (instructions, tools, ...).
    request: dict[str, Any] = field(default_factory=dict)
    # Usage on every chunk (continuous_usage_stats, or --enable-force-include-usage).
    continuous_usage: bool = False
    # The prompt's place in a completions batch (its choices' ``index``).
    index: int = 0
    # Where the answer starts in ``wire.WORDS``: a function of its context (``text.py``).
    first_word: int = 0
    # The prompt's token ids when the request asked for them (``return_token_ids``), else None.
    prompt_ids: list[int] | None = None


class Framer(Protocol):
    """How one route frames a generation as SSE events."""

    def opening(self) -> list[bytes]: ...
    def token(self, index: int, last: bool) -> bytes: ...
    def closing(self) -> list[bytes]: ...
    def error(self, message: str) -> list[bytes]: ...


class _OpenAIFramer:
    def __init__(self, gen: Generation) -> None:
        self.gen = gen

    def _so_far(self, completion_tokens: int) -> dict[str, int] | None:
        if not self.gen.continuous_usage:
            return None
        return wire.usage(self.gen.prompt_tokens, completion_tokens)

    def opening(self) -> list[bytes]:
        gen = self.gen
        if gen.route == "chat":
            usage = self._so_far(0)
            return [
                wire.chat_role_chunk(gen.response_id, gen.created, gen.model, usage, gen.prompt_ids)
            ]
        return []

    def token(self, index: int, last: bool) -> bytes:
        gen = self.gen
        text = wire.output_text(gen.first_word + index, 1)
        ids = None if gen.prompt_ids is None else wire.word_ids(gen.first_word + index, 1)
        finish = gen.finish_reason if last else None
        usage = self._so_far(index + 1)
        if gen.route == "chat":
            return wire.chat_content_chunk(
                gen.response_id, gen.created, gen.model, text, finish, usage, ids
            )
        prompt_ids = gen.prompt_ids if index == 0 else None
        return wire.completion_chunk(
            gen.response_id,
            gen.created,
            gen.model,
            text,
            finish,
            usage,
            (gen.index, prompt_ids, ids),
        )

    def error(self, message: str) -> list[bytes]:
        return [wire.stream_error(message, "InternalServerError", 500), wire.DONE]

    def closing(self) -> list[bytes]:
        gen = self.gen
        if not gen.include_usage:
            return [wire.DONE]
        build = wire.chat_usage_chunk if gen.route == "chat" else wire.completion_usage_chunk
        usage = build(gen.response_id, gen.created, gen.model, gen.prompt_tokens, gen.output_tokens)
        return [usage, wire.DONE]


class _TypedFramer:
    """Responses and Anthropic Messages: typed events, no ``[DONE]``."""

    def __init__(self, gen: Generation) -> None:
        self.gen = gen
        self.events: wire_apis.ResponsesEvents | wire_apis.MessagesEvents
        if gen.route == "responses":
            self.events = wire_apis.ResponsesEvents(
                gen.response_id, gen.created, gen.model, gen.request
            )
        else:
            self.events = wire_apis.MessagesEvents(gen.response_id, gen.model, gen.prompt_tokens)

    def opening(self) -> list[bytes]:
        return self.events.opening()

    def token(self, index: int, last: bool) -> bytes:
        return self.events.token(wire.output_text(self.gen.first_word + index, 1))

    def closing(self) -> list[bytes]:
        gen = self.gen
        return self.events.closing(gen.finish_reason, gen.prompt_tokens, gen.output_tokens)

    def error(self, message: str) -> list[bytes]:
        if self.gen.route == "messages":
            return [wire_apis.event("error", wire_apis.anthropic_error_body(message, 500))]
        return [wire_apis.event("error", {"type": "error", "code": "500", "message": message})]


def framer(gen: Generation) -> Framer:
    if gen.route in ("chat", "completions"):
        return _OpenAIFramer(gen)
    return _TypedFramer(gen)


async def _stall(faults: FaultState) -> None:
    faults.injected["stall"] += 1
    seconds = faults.spec.stall_for_s
    if seconds is None:
        await asyncio.Event().wait()  # for ever: only the client going away ends it
    else:
        await asyncio.sleep(seconds)


class _Sender:
    """Counts chunks and tokens sent, applying the stream faults in force at each chunk."""

    def __init__(self, faults: FaultState) -> None:
        self.faults = faults
        self.chunks = 0
        self.tokens = 0
        self.stalled = False

    async def before_chunk(self, carries_token: bool) -> None:
        spec = self.faults.spec
        if spec.drop_after_chunks is not None and self.chunks >= spec.drop_after_chunks:
            self.faults.injected["drop"] += 1
            raise DroppedConnection("injected fault: drop_after_chunks")
        stall_at = spec.stall_after_tokens
        if carries_token and not self.stalled and stall_at is not None and self.tokens >= stall_at:
            self.stalled = True
            await _stall(self.faults)
        self.chunks += 1
        self.tokens += carries_token


async def stream_body(
    gen: Generation, engine: SimEngine, stream: RequestStream, faults: FaultState
) -> AsyncIterator[bytes]:
    sender = _Sender(faults)
    frames = framer(gen)
    opened = False
    try:
        while True:
            try:
                start, count, last = await stream.next_tokens()
            except EngineCrashed as exc:
                if exc.reason != "engine_dead":
                    raise DroppedConnection("engine crashed") from exc
                for chunk in frames.error(wire.ENGINE_DEAD_MESSAGE):
                    yield chunk
                return
            if not opened:  # sent with the first token, as vLLM sends its first chunk
                for chunk in frames.opening():
                    await sender.before_chunk(carries_token=False)
                    yield chunk
                opened = True
            for index in range(start, start + count):
                await sender.before_chunk(carries_token=True)
                yield frames.token(index, last and index == start + count - 1)
            if last:
                break
        for chunk in frames.closing():
            await sender.before_chunk(carries_token=False)
            yield chunk
    finally:
        engine.abort(stream.key)


async def _pump(
    index: int,
    stream: RequestStream,
    queue: asyncio.Queue[tuple[int, int, int, bool] | EngineCrashed],
) -> None:
    try:
        while True:
            start, count, last = await stream.next_tokens()
            queue.put_nowait((index, start, count, last))
            if last:
                return
    except EngineCrashed as exc:
        queue.put_nowait(exc)


async def stream_batch_body(
    gens: list[Generation],
    engine: SimEngine,
    streams: list[RequestStream],
    faults: FaultState,
) -> AsyncIterator[bytes]:
    """A completions batch as one SSE stream: each prompt's chunks under its index."""
    sender = _Sender(faults)
    frames = [_OpenAIFramer(gen) for gen in gens]
    queue: asyncio.Queue[tuple[int, int, int, bool] | EngineCrashed] = asyncio.Queue()
    pumps = [asyncio.ensure_future(_pump(i, s, queue)) for i, s in enumerate(streams)]
    try:
        remaining = len(gens)
        while remaining:
            item = await queue.get()
            if isinstance(item, EngineCrashed):
                if item.reason != "engine_dead":
                    raise DroppedConnection("engine crashed") from item
                for chunk in frames[0].error(wire.ENGINE_DEAD_MESSAGE):
                    yield chunk
                return
            i, start, count, last = item
            for index in range(start, start + count):
                await sender.before_chunk(carries_token=True)
                yield frames[i].token(index, last and index == start + count - 1)
            remaining -= last
        first = gens[0]
        if first.include_usage:
            prompt = sum(g.prompt_tokens for g in gens)
            output = sum(g.output_tokens for g in gens)
            await sender.before_chunk(carries_token=False)
            yield wire.completion_usage_chunk(
                first.response_id, first.created, first.model, prompt, output
            )
        await sender.before_chunk(carries_token=False)
        yield wire.DONE
    finally:
        for task in pumps:
            task.cancel()
        for stream in streams:
            engine.abort(stream.key)


class EngineStreamingResponse(StreamingResponse):
    """An SSE response that aborts its engine request however it ends.

    The body generator's own ``finally`` is not enough: if the client is gone before Starlette
    first iterates it, the generator never starts, so its ``finally`` never runs. And the abort
    happens when the disconnect arrives, not once Starlette has unwound the response: on a
    loaded machine that unwinding was seen to lag the disconnect by one to several seconds.
    """

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], object]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def receive_or_abort() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._on_close()  # idempotent: the finally below finds nothing left to abort
            return message

        try:
            await super().__call__(scope, receive_or_abort, send)
        finally:
            self._on_close()


async def full_body(gen: Generation, stream: RequestStream) -> dict[str, Any]:
    last = False
    while not last:
        _, _, last = await stream.next_tokens()
    text = wire.output_text(gen.first_word, gen.output_tokens)
    args = (gen.prompt_tokens, gen.output_tokens)
    if gen.route == "responses":
        return wire_apis.response_full(
            gen.response_id, gen.created, gen.model, gen.request, text, gen.finish_reason, args
        )
    if gen.route == "messages":
        return wire_apis.message_full(gen.response_id, gen.model, text, gen.finish_reason, *args)
    build = wire.chat_response if gen.route == "chat" else wire.completion_response
    return build(gen.response_id, gen.created, gen.model, text, gen.finish_reason, *args)


async def full_batch_body(gens: list[Generation], streams: list[RequestStream]) -> dict[str, Any]:
    """The body of a completions batch: one choice per prompt, the usage summed."""
    choices = []
    for gen, stream in zip(gens, streams, strict=True):
        last = False
        while not last:
            _, _, last = await stream.next_tokens()
        text = wire.output_text(gen.first_word, gen.output_tokens)
        choices.append(wire.completion_choice(gen.index, text, gen.finish_reason))
    first = gens[0]
    return wire.completion_batch_response(
        first.response_id,
        first.created,
        first.model,
        choices,
        sum(g.prompt_tokens for g in gens),
        sum(g.output_tokens for g in gens),
    )


async def _until_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(receive: Receive, coro: Awaitable[T]) -> tuple[bool, T | None]:
    """(True, result) if ``coro`` finished first; (False, None) if the client went away first."""
    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(_until_disconnect(receive))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, gone):
            if not task.done():
                task.cancel()
        await asyncio.gather(work, gone, return_exceptions=True)
    if work.done() and not work.cancelled():
        return True, work.result()
    return False, None
