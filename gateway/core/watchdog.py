"""Per-request deadlines, set by lane.

A heavy lane is legitimately slow: its first byte waits for a prefill of minutes. So the first
byte deadline grows with the prompt: ``first_byte_s + first_byte_per_1k_tokens_s * tokens/1000``.
The other deadlines are the lane's own: connect, the longest silence between two stream chunks
(idle), and the whole request (total, counted from the moment the upstream request is sent).
The first-byte deadline bounds streamed requests only: a non-streamed answer's headers come
with its last token (vLLM), so the proxy waits for them under the total deadline.

``deadlines_for`` is pure. ``Watch.within(kind)`` bounds one await by the tighter of that phase's
deadline and what is left of the total, and turns a hit into ``DeadlineHit`` naming the phase,
which the pipeline reports to the client (504 before the first byte, an SSE error event after it),
logs and counts in ``shapegate_watchdog_events_total{lane,cluster,kind}``.
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType
from typing import Literal, NamedTuple

from gateway.core.cancel import CancelScope
from gateway.errors import UpstreamTimeout
from gateway.settings import TimeoutSettings

Phase = Literal["connect", "first_byte", "idle", "total"]


class DeadlineHit(UpstreamTimeout):
    def __init__(self, kind: Phase, seconds: float) -> None:
        super().__init__(f"upstream {kind.replace('_', ' ')} deadline of {seconds:g}s exceeded")
        self.kind: Phase = kind


class Deadlines(NamedTuple):
    """A request's deadlines. A named tuple, not a frozen dataclass: one a request, and
    a frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``."""

    connect_s: float
    first_byte_s: float
    idle_s: float
    total_s: float


def deadlines_for(timeouts: TimeoutSettings, prompt_tokens: int) -> Deadlines:
    first_byte = timeouts.first_byte_s + timeouts.first_byte_per_1k_tokens_s * prompt_tokens / 1000
    return Deadlines(
        connect_s=timeouts.connect_s,
        first_byte_s=first_byte,
        idle_s=timeouts.idle_s,
        total_s=max(timeouts.total_s, first_byte),
    )


class Watch:
    """The deadlines of one request, measured from its start."""

    def __init__(self, deadlines: Deadlines, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.deadlines = deadlines
        self._started = time.monotonic()
        # The running loop when the caller holds it: each scope's timer goes on it without
        # asking for it (a getpid system call in Python 3.11; gateway/core/cancel.py).
        self._loop = loop

    def _limit(self, kind: Phase) -> float:
        return {
            "connect": self.deadlines.connect_s,
            "first_byte": self.deadlines.first_byte_s,
            "idle": self.deadlines.idle_s,
            "total": self.deadlines.total_s,
        }[kind]

    def left_s(self) -> float:
        """What is left of the total deadline."""
        return max(0.0, self.deadlines.total_s - (time.monotonic() - self._started))

    def within(self, kind: Phase) -> _Within:
        """``with watch.within(kind):`` bounds the block by the tighter of that phase's
        deadline and what is left of the total; a hit raises ``DeadlineHit`` naming which."""
        phase_s = self._limit(kind)
        left_s = self.deadlines.total_s - (time.monotonic() - self._started)
        hit: Phase = kind if phase_s <= left_s else "total"
        seconds = min(phase_s, left_s)
        # asyncio's own cancellation (gateway/core/cancel.py), not anyio's: one a request.
        return _Within(max(seconds, 0.0), self, hit, self._loop)


class _Within(CancelScope):
    """``Watch.within``'s scope: a class, not a generator context manager (its generator and
    contextlib's three calls around it, on every upstream wait)."""

    __slots__ = ("_hit", "_watch")

    def __init__(
        self, seconds: float, watch: Watch, hit: Phase, loop: asyncio.AbstractEventLoop | None
    ) -> None:
        super().__init__(deadline_s=seconds, loop=loop)
        self._watch = watch
        self._hit: Phase = hit

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:  # never swallows: its own cancellation becomes ``DeadlineHit``
        if super().__exit__(exc_type, exc, tb):
            raise DeadlineHit(self._hit, self._watch._limit(self._hit))
        return False
