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
- ``engine_usage(payload)``: ``usage.prompt_tokens`` and ``usage.completion_tokens`` from a
  JSON body or the last SSE event that carries usage (None for each where absent).
- ``sse_events(data)`` and ``trim_tail(tail)``: the SSE data events of a relayed stream, for an
  output-token estimate when the engine sends no usage (each content event carries one token
  on vLLM and SGLang; fewer events than tokens with speculative decoding or a stream interval,
  hence an estimate). The relay keeps the stream's last KiB for its usage and counts the events
  of what it drops in bulk, so the per-chunk cost is one concatenation.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import orjson

from gateway.count.tokens import TokenCount, TokenCounter


@dataclass(frozen=True, slots=True)
class EngineUsage:
    prompt_tokens: int | None
    completion_tokens: int | None


def engine_usage(payload: bytes) -> EngineUsage:
    """The engine's ``usage`` from a JSON body or the last SSE event that carries it."""
    at = payload.rfind(b'"usage"')
    if at < 0:
        return EngineUsage(None, None)
    start = payload.rfind(b"{", 0, at)
    end = payload.find(b"\n", at)
    for blob in (payload, payload[start : end if end > 0 else None]):
        try:
            usage = orjson.loads(blob.removeprefix(b"data: ")).get("usage") or {}
        except (orjson.JSONDecodeError, AttributeError):
            continue
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        return EngineUsage(
            prompt if isinstance(prompt, int) else None,
            completion if isinstance(completion, int) else None,
        )
    return EngineUsage(None, None)


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
        self.bound = count.tokens if count.exact is None else None
        # The count running in the counting worker while the engine works, when it could not be
        # had inline (an out-of-process encoder, large missing pieces, the encoder busy).
        self._pending: asyncio.Task[TokenCount] | None = None
        # Why the exact count is missing at the end, if counting itself failed.
        self.error: BaseException | None = None

    def meanwhile(self) -> None:
        """The request is on its way to the engine: count now, inline when that is cheap, else
        start the count in the worker so that it overlaps the engine's work."""
        if self._count.exact is not None or self._pending is not None:
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
        if self._count.exact is None:
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
        elif self._count.exact is None:
            self._count = self._counter.exact_now(self._count) or self._count
        return self._count.exact
