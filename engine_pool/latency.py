"""Slow engines among their peers: each endpoint's time to first token and inter-token time
against the other endpoints of its cluster, for prompts of similar size.

A health probe answers in milliseconds on an engine that takes seconds to its first token; only
the requests themselves show it. Heavy lanes are slow on purpose, so the yardstick is never an
absolute time but the endpoint's peers, serving the same lane at the same moment.

Contract:
- ``LatencyBook.observe(cluster, url, prompt_tokens, ttft_s, itl_s, now)`` keeps one sample per
  finished request (O(1); at most ``per_endpoint`` samples an endpoint, none older than
  ``window_s``). ``itl_s`` is the mean time per output token after the first (None when the
  request streamed too little to tell).
- ``judge(book, now)`` is pure over the samples and returns, per endpoint seen, its TTFT p95 and
  whether it is slow, with the evidence. Prompts are grouped in size classes (under 1k tokens,
  then each class 4x the last); in a class where the endpoint and at least one peer each have
  ``MIN_SAMPLES`` samples, the endpoint is slow when its median TTFT (or inter-token time) is
  above ``FACTOR`` times the median of its peers' medians and above it by at least the floor
  (``TTFT_FLOOR_S``, ``ITL_FLOOR_S``): noise on fast requests never counts.
- Slow is reported (admin state, dashboard, ``shapegate_engine_slow``, ``engine.slow_requests``)
  and never changes routing.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

MIN_SAMPLES = 5
FACTOR = 3.0
TTFT_FLOOR_S = 0.5
ITL_FLOOR_S = 0.05


@dataclass(frozen=True, slots=True)
class Sample:
    at: float
    prompt_tokens: int
    ttft_s: float
    itl_s: float | None


@dataclass(frozen=True, slots=True)
class Latency:
    ttft_p95: float | None
    slow: str | None  # the evidence, when slow


def size_class(prompt_tokens: int) -> int:
    """0 below 1k tokens, then 1 below 4k, 2 below 16k ..."""
    if prompt_tokens < 1024:
        return 0
    return 1 + int(math.log(prompt_tokens / 1024, 4))


def class_name(index: int) -> str:
    if index == 0:
        return "<1k"
    low = 1024 * 4 ** (index - 1)
    return f"{low // 1024}k-{low * 4 // 1024}k"


class LatencyBook:
    def __init__(self, window_s: float = 300.0, per_endpoint: int = 256) -> None:
        self.window_s = window_s
        self._per_endpoint = per_endpoint
        self._samples: dict[tuple[str, str], deque[Sample]] = {}

    def observe(
        self,
        cluster: str,
        url: str,
        prompt_tokens: int,
        ttft_s: float,
        itl_s: float | None,
        now: float,
    ) -> None:
        samples = self._samples.get((cluster, url))
        if samples is None:
            samples = self._samples[(cluster, url)] = deque(maxlen=self._per_endpoint)
        samples.append(Sample(now, prompt_tokens, ttft_s, itl_s))

    def forget(self, keep: Iterable[tuple[str, str]]) -> None:
        """Drop endpoints no longer in the policy (after a reload)."""
        wanted = set(keep)
        for key in [k for k in self._samples if k not in wanted]:
            del self._samples[key]

    def recent(self, now: float) -> dict[tuple[str, str], list[Sample]]:
        since = now - self.window_s
        return {
            key: [s for s in samples if s.at >= since] for key, samples in self._samples.items()
        }


def _p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def _outlier(
    mine: list[float], peers: list[list[float]], floor_s: float
) -> tuple[float, float, int] | None:
    """(my median, the peers' median, peers compared) when mine is an outlier, else None."""
    ready = [p for p in peers if len(p) >= MIN_SAMPLES]
    if len(mine) < MIN_SAMPLES or not ready:
        return None
    own = statistics.median(mine)
    typical = statistics.median(statistics.median(p) for p in ready)
    if own > FACTOR * typical and own - typical >= floor_s:
        return own, typical, len(ready)
    return None


def _fmt(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


# (cluster, url) -> size class -> (TTFTs, inter-token times)
_Table = dict[tuple[str, str], dict[int, tuple[list[float], list[float]]]]


def _table(recent: dict[tuple[str, str], list[Sample]]) -> _Table:
    table: _Table = {}
    for key, samples in recent.items():
        classes = table[key] = {}
        for s in samples:
            ttfts, itls = classes.setdefault(size_class(s.prompt_tokens), ([], []))
            ttfts.append(s.ttft_s)
            if s.itl_s is not None:
                itls.append(s.itl_s)
    return table


def _evidence(table: _Table, key: tuple[str, str], peers: list[tuple[str, str]]) -> str | None:
    for cls, (ttfts, itls) in sorted(table[key].items()):
        for column, mine, label, floor in (
            (0, ttfts, "TTFT", TTFT_FLOOR_S),
            (1, itls, "time per output token", ITL_FLOOR_S),
        ):
            theirs = [table[p][cls][column] for p in peers if cls in table[p]]
            found = _outlier(mine, theirs, floor)
            if found is not None:
                own, typical, compared = found
                return (
                    f"{label} median {_fmt(own)} over {len(mine)} requests of "
                    f"{class_name(cls)} tokens, {own / typical:.0f}x the {_fmt(typical)} of "
                    f"{compared} peer{'s' if compared > 1 else ''}"
                )
    return None


def judge(book: LatencyBook, now: float) -> dict[tuple[str, str], Latency]:
    recent = book.recent(now)
    table = _table(recent)
    out: dict[tuple[str, str], Latency] = {}
    for key in recent:
        peers = [k for k in recent if k[0] == key[0] and k != key]
        ttft_p95 = _p95([s.ttft_s for s in recent[key]])
        out[key] = Latency(ttft_p95, _evidence(table, key, peers))
    return out
