"""The token figures of one request: our exact prompt count and what the engine reports.

Contract:
- ``ExactCount.start(counter, count)``: when the lane was decided by the free UTF-8 bound, the
  exact count is finished by a task started just before the request goes to the engine, so it
  runs while the engine works (off the request's critical path); ``await tokens()`` before the
  response headers go out (by then it has long finished: a small prompt costs microseconds when
  cached, well under a millisecond when not). A count that was exact already costs nothing.
  ``settle()`` at the end gives the figure if known and cancels a count still running, so no
  task outlives its request; a count that failed is reported through ``swallowed``.
- ``engine_usage(payload)``: ``usage.prompt_tokens`` and ``usage.completion_tokens`` from a
  JSON body or the last SSE event that carries usage (None for each where absent).
- ``sse_events(chunk)``: the SSE data events in a relayed chunk, for an output-token estimate
  when the engine sends no usage: each content event carries one token on vLLM and SGLang
  (fewer events than tokens with speculative decoding or a stream interval, hence an estimate).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import orjson

from gateway.log import Logger, swallowed
from gateway.metrics import Metrics
from gateway.tokens import TokenCount, TokenCounter


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


def sse_events(chunk: bytes) -> int:
    return chunk.count(b"data: {")


class ExactCount:
    """Our exact prompt count, finished while the engine works when the bound decided."""

    __slots__ = ("_count", "_task", "bound", "decided_by")

    def __init__(self, count: TokenCount, task: asyncio.Task[TokenCount] | None) -> None:
        self._count = count
        self._task = task
        # The figure the lane was decided by, and the UTF-8 bound when that was it (a bound is
        # never to be reported as tokens).
        self.decided_by = count.tokens
        self.bound = count.tokens if count.exact is None else None

    @classmethod
    def start(cls, counter: TokenCounter, count: TokenCount) -> ExactCount:
        if count.exact is not None:
            return cls(count, None)
        return cls(count, asyncio.get_running_loop().create_task(counter.exact(count)))

    async def tokens(self) -> int:
        task, self._task = self._task, None
        if task is not None:
            self._count = await task
        assert self._count.exact is not None
        return self._count.exact

    def settle(self, log: Logger, metrics: Metrics, request_id: str) -> int | None:
        """The exact count if it finished; one still running is cancelled (None)."""
        task, self._task = self._task, None
        if task is None:
            return self._count.exact
        if not task.done():
            task.cancel()
            return None
        if task.cancelled():
            return None
        exc = task.exception()
        if exc is not None:
            swallowed(
                log,
                metrics,
                "usage.exact_count",
                exc,
                "prompt_tokens_unknown",
                request_id=request_id,
            )
            return None
        self._count = task.result()
        return self._count.exact
