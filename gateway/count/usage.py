"""The token figures of one request: our exact prompt count and what the engine reports.

Contract:
- ``ExactCount(counter, count)``: when the lane was decided by the free UTF-8 bound, the exact
  count is finished from the plan the bound kept, by ``meanwhile()``, which the proxy calls once
  the request is written to the engine and before it waits for the answer, so it overlaps the
  engine's work: inline when that is cheap (an in-process encoder and small missing pieces:
  microseconds when cached), else started in the counting worker (always so with the bounded
  child-process encoder, whose pipe round trip never runs on the event loop). ``await
  tokens(wait_s)`` before the response headers go out waits at most ``wait_s`` for it.
  ``settle()`` at the end gives the figure (None only when the worker had not finished, or
  failed: ``error``).
- ``engine_usage(payload)``: the engine's prompt and output tokens from a JSON body or the last
  SSE events that carry usage, on every route (``prompt_tokens``/``completion_tokens``; the
  ``input_tokens``/``output_tokens`` of Responses and Messages); None for each where absent.
- ``sse_events(data)`` and ``trim_tail(tail)``: the SSE data events of a relayed stream, for an
  output-token estimate when the engine sends no usage (each content event carries one token
  on vLLM and SGLang; fewer events than tokens with speculative decoding or a stream interval,
  hence an estimate). The relay keeps the stream's last KiB for its usage and counts the events
  of what it drops in bulk, so the per-chunk cost is one concatenation.
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

import orjson

from gateway.core.count import TokenCount
from gateway.count.tokens import TokenCounter


class EngineUsage(NamedTuple):
    """The engine's own usage figures. A named tuple, not a frozen dataclass: one a request,
    and a frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``."""

    prompt_tokens: int | None
    completion_tokens: int | None


def engine_usage(payload: bytes) -> EngineUsage:
    """The engine's usage from a JSON body or the last SSE events that carry it, on every route:
    ``prompt_tokens``/``completion_tokens`` (chat, completions), ``input_tokens``/
    ``output_tokens`` (Responses: the body's or ``response.completed``'s ``response.usage``;
    Messages: the body's ``usage``, ``message_start``'s ``message.usage`` and
    ``message_delta``'s ``usage``, where Anthropic's cache counts are added back to the input).
    The newest usage object wins; a figure it lacks is taken from the one before."""
    prompt: int | None = None
    completion: int | None = None
    end = len(payload)
    for _ in range(USAGE_LOOKBACK):
        at = payload.rfind(USAGE_KEY, 0, end)
        if at < 0:
            break
        end = at
        usage = _object_after(payload, at + len(USAGE_KEY))
        if usage is None:  # "usage": null on a chunk without it
            continue
        found_prompt, found_completion = _figures(usage)
        prompt = found_prompt if prompt is None else prompt
        completion = found_completion if completion is None else completion
        if prompt is not None and completion is not None:
            break
    return EngineUsage(prompt, completion)


USAGE_KEY = b'"usage"'
# Usage objects looked at, newest first: a Messages stream has two (message_start, then
# message_delta), a chat stream with --enable-force-include-usage one a chunk.
USAGE_LOOKBACK = 4
# A usage object is a few hundred bytes; past this, what follows the key is not one.
USAGE_MAX_BYTES = 4096
# Closing braces tried by a parse before ``_object_after`` matches braces byte by byte.
FAST_TRIES = 4


def _object_after(payload: bytes, at: int) -> dict[str, object] | None:
    """The JSON object that follows ``"usage"`` at ``at`` (None for null or anything else).
    Read by matching braces: a Responses ``response.completed`` event holds the whole answer,
    longer than the tail the relay keeps, so its line may have lost its start."""
    start = at
    while start < len(payload) and payload[start] in b" \t\r\n:":
        start += 1
    if start >= len(payload) or payload[start] != ord("{"):
        return None
    limit = min(len(payload), start + USAGE_MAX_BYTES)
    # The object ends at one of the next closing braces: the first slice up to one that parses
    # is the object the brace matching below finds (a JSON object ends where its braces close,
    # so no shorter slice parses, and no longer one does). A usage object of a few fields and a
    # details object or two ends at its first or third brace: a parse or three instead of a
    # Python loop over every byte (a twentieth of a small request's CPU).
    end = start
    for _ in range(FAST_TRIES):
        end = payload.find(b"}", end + 1, limit)
        if end < 0:
            return None  # no brace closes within the bound: the loop below finds none either
        try:
            found = orjson.loads(payload[start : end + 1])
        except orjson.JSONDecodeError:
            continue
        return found if isinstance(found, dict) else None
    depth, quoted, escaped = 0, False, False
    for i in range(start, min(len(payload), start + USAGE_MAX_BYTES)):
        byte = payload[i]
        if escaped:
            escaped = False
        elif quoted:
            escaped = byte == ord("\\")
            quoted = byte != ord('"')
        elif byte == ord('"'):
            quoted = True
        elif byte == ord("{"):
            depth += 1
        elif byte == ord("}"):
            depth -= 1
            if depth == 0:
                try:
                    found = orjson.loads(payload[start : i + 1])
                except orjson.JSONDecodeError:
                    return None
                return found if isinstance(found, dict) else None
    return None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _figures(usage: dict[str, object]) -> tuple[int | None, int | None]:
    prompt = _int(usage.get("prompt_tokens"))
    if prompt is None:
        prompt = _int(usage.get("input_tokens"))
        if prompt is not None:  # Anthropic counts cached input apart from input_tokens
            for cached in ("cache_read_input_tokens", "cache_creation_input_tokens"):
                prompt += _int(usage.get(cached)) or 0
    completion = _int(usage.get("completion_tokens"))
    if completion is None:
        completion = _int(usage.get("output_tokens"))
    return prompt, completion


EVENT = b"data: {"
# The relay keeps between TAIL_KEEP and TAIL_MAX bytes of a stream's end (where usage arrives),
# counting the data events of what it drops: one count per ~4 KiB, not one per chunk.
TAIL_KEEP = 4096
TAIL_MAX = 2 * TAIL_KEEP


def sse_events(data: bytes) -> int:
    return data.count(EVENT)


def trim_tail(tail: bytes) -> tuple[bytes, int]:
    """The last ``TAIL_KEEP`` bytes, and the data events that start before them (an event cut
    in two by the trim is counted here, once)."""
    cut = len(tail) - TAIL_KEEP
    return tail[cut:], tail.count(EVENT, 0, cut + len(EVENT) - 1)


class ExactCount:
    """Our exact prompt count; when the bound decided the lane, finished while the engine works."""

    __slots__ = ("_count", "_counter", "_pending", "bound", "decided_by", "error")

    def __init__(self, counter: TokenCounter, count: TokenCount) -> None:
        self._counter = counter
        self._count = count
        # The figure the lane was decided by, and the UTF-8 bound when that was it (a bound is
        # never to be reported as tokens).
        self.decided_by = count.tokens
        self.bound = count.tokens if count.method == "bound" else None
        # The count running in the counting worker while the engine works, when it could not be
        # had inline (an out-of-process encoder, large missing pieces, the encoder busy).
        self._pending: asyncio.Task[TokenCount] | None = None
        # Why the exact count is missing at the end, if counting itself failed.
        self.error: BaseException | None = None

    def meanwhile(self) -> None:
        """The request is on its way to the engine: count now, inline when that is cheap, else
        start the count in the worker so that it overlaps the engine's work."""
        if self._count.method != "bound" or self._pending is not None:
            return
        step = self._counter.start_exact(self._count)
        if isinstance(step, TokenCount):
            self._count = step
        else:  # the cache was looked up: the worker encodes only the missing pieces
            self._pending = asyncio.get_running_loop().create_task(self._counter.finish(step))

    async def tokens(self, wait_s: float) -> int | None:
        """The exact count for the response headers, waiting at most ``wait_s`` for the worker:
        a congested counter never delays the first byte past that (None then: the headers carry
        the bound under its own name only, and the count is still taken at ``settle``)."""
        if self._count.method == "bound":
            self.meanwhile()
        pending = self._pending
        if pending is not None:
            if not pending.done():
                await asyncio.wait({pending}, timeout=wait_s)  # never cancels the count
            if pending.done():
                self._take(pending)
        return self._count.exact

    def _take(self, pending: asyncio.Task[TokenCount]) -> None:
        self._pending = None
        if pending.cancelled():
            return
        self.error = pending.exception()
        if self.error is None:
            self._count = pending.result()

    def settle(self) -> int | None:
        """The exact count at the request's end: None when it needed the worker and the request
        ended before the worker finished (the count is then abandoned), or when counting failed
        (``error`` says why)."""
        pending = self._pending
        if pending is not None:
            if pending.done():
                self._take(pending)
            else:
                self._pending = None
                pending.cancel()
        elif self._count.method == "bound":
            step = self._counter.start_exact(self._count)
            if isinstance(step, TokenCount):  # else it needs the worker: abandoned, as above
                self._count = step
        return self._count.exact
