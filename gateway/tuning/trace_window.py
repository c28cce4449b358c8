"""A few minutes out of a long trace, for playing it live (``shapegate trace cut``).

- ``cut(trace, start, duration)``: the requests with ``start <= t < start + duration``, their
  ``t`` rebased to the window's start; raises ``ValueError`` when the window holds none.
- ``busiest(trace, duration, small_below)``: the start of the window worth playing: the most
  monsters (prompts of ``small_below`` tokens or more), then the most requests. Candidate starts
  are a little before each monster (a monster just before a burst is the case a policy must
  get right) and each request's own time.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

from gateway.observe.trace import TraceRecord

# A window opens this many seconds before a monster, so the requests it delays are inside.
LEAD_S = 5.0


def cut(trace: Sequence[TraceRecord], start: float, duration: float) -> list[TraceRecord]:
    if duration <= 0:
        raise ValueError("the window's duration must be positive")
    chosen = [
        dataclasses.replace(r, t=round(r.t - start, 3))
        for r in trace
        if start <= r.t < start + duration
    ]
    if not chosen:
        raise ValueError(f"no request in [{start:g}, {start + duration:g}) s of the trace")
    return sorted(chosen, key=lambda r: r.t)


def busiest(trace: Sequence[TraceRecord], duration: float, small_below: int = 32768) -> float:
    if not trace:
        raise ValueError("an empty trace has no window")
    times = sorted(r.t for r in trace)
    monsters = sorted(r.t for r in trace if r.prompt_tokens >= small_below)
    starts = {max(0.0, t - LEAD_S) for t in monsters} | set(times)

    def score(start: float) -> tuple[int, int, float]:
        end = start + duration
        big = bisect.bisect_left(monsters, end) - bisect.bisect_left(monsters, start)
        count = bisect.bisect_left(times, end) - bisect.bisect_left(times, start)
        return big, count, -start

    return max(starts, key=score)
