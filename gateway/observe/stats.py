"""The dashboard's rolling window: per-lane rates and latency percentiles over the last minutes.

Prometheus keeps the authoritative histograms; this window exists so the ops page answers "how
is each lane doing right now" without a Prometheus server next to the gateway.

Contract:
- ``RollingWindow.observe(lane, outcome, ttft_s, duration_s)`` takes one finished request
  (gateway/observe/recorder.py's ``Recorder`` calls it once, as the request finishes): it counts the
  request in its lane's current time bucket by outcome, and adds its TTFT and duration when
  given (the recorder gives them for requests that were admitted).
- ``gauge(lane, slots_in_use, queue_depth)`` samples the lane's gauges into the current bucket
  (the bucket keeps the maximum); the dashboard samples them each time it builds its state.
- ``lane_json(lane)`` answers the request rate over the last minute, p50/p95/p99 of TTFT and
  duration over ``span_s``, outcome counts, and one small series per quantity over ``keep_s``
  (closed buckets only, each summarised once).
- Memory is bounded whatever the request rate: ``keep_s / bucket_s`` buckets per lane, each
  holding counts in logarithmic latency bins 4% wide (about 450 from 0.1 ms to an hour), so a
  percentile is within about 2% of the exact value.
- Times are ``time.monotonic()`` seconds; every method takes ``now`` so tests need no sleep.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

BIN_FLOOR_S = 1e-4
BIN_GROWTH = 1.04
_LOG_GROWTH = math.log(BIN_GROWTH)
QUANTILES = (0.5, 0.95, 0.99)
FAILED = frozenset({"upstream_error", "timeout", "error"})
RATE_WINDOW_S = 60.0


def bin_of(seconds: float) -> int:
    if seconds <= BIN_FLOOR_S:
        return 0
    return int(math.log(seconds / BIN_FLOOR_S) / _LOG_GROWTH) + 1


def bin_value(index: int) -> float:
    """The geometric middle of a bin: within half a bin (2%) of every value it holds."""
    if index == 0:
        return BIN_FLOOR_S
    return float(f"{BIN_FLOOR_S * BIN_GROWTH ** (index - 0.5):.4g}")  # short in JSON


def quantiles(bins: Counter[int], qs: tuple[float, ...] = QUANTILES) -> list[float | None]:
    """Nearest-rank quantiles of a binned sample; None for an empty sample."""
    n = sum(bins.values())
    if n == 0:
        return [None for _ in qs]
    ranks = [max(1, math.ceil(q * n)) for q in qs]
    out: list[float | None] = []
    seen = 0
    order = iter(sorted(bins.items()))
    index = -1
    for rank in ranks:
        while seen < rank:
            index, count = next(order)
            seen += count
        out.append(bin_value(index))
    return out


@dataclass(slots=True)
class _Bucket:
    index: int
    outcomes: Counter[str] = field(default_factory=Counter)
    ttft: Counter[int] = field(default_factory=Counter)
    e2e: Counter[int] = field(default_factory=Counter)
    slots: int | None = None
    queue: int | None = None
    summary: dict[str, float | None] | None = None

    def summarise(self, seconds: float) -> dict[str, float | None]:
        finished = sum(self.outcomes.values())
        failed = sum(n for outcome, n in self.outcomes.items() if outcome in FAILED)
        ttft = quantiles(self.ttft, (0.5, 0.95))
        e2e = quantiles(self.e2e, (0.5, 0.95))
        return {
            "rate": round(finished / seconds, 3),
            "failed": round(failed / seconds, 3),
            "ttft_p50": ttft[0],
            "ttft_p95": ttft[1],
            "e2e_p50": e2e[0],
            "e2e_p95": e2e[1],
            "slots": None if self.slots is None else float(self.slots),
            "queue": None if self.queue is None else float(self.queue),
        }


class _Lane:
    """One lane's buckets plus running sums over the percentile span."""

    def __init__(self, first_seen: float) -> None:
        self.first_seen = first_seen
        self.buckets: dict[int, _Bucket] = {}
        self.span_ttft: Counter[int] = Counter()
        self.span_e2e: Counter[int] = Counter()
        self.span_outcomes: Counter[str] = Counter()
        self.span_from = 0
        self.at = -1

    def advance(self, now_index: int, keep: int, span: int, bucket_s: float) -> None:
        # Work only when time entered a new bucket: observe() stays O(1) per request.
        if now_index <= self.at:
            return
        closed = self.buckets.get(self.at)
        if closed is not None:
            # Summarised once as it closes, so the first page load after hours costs no more.
            closed.summary = closed.summarise(bucket_s)
        self.at = now_index
        new_from = now_index - span + 1
        # Buckets that exist were made at or before the last advance: span_from + span - 1.
        for index in range(self.span_from, min(new_from, self.span_from + span)):
            old = self.buckets.get(index)
            if old is not None:
                self.span_ttft.subtract(old.ttft)
                self.span_e2e.subtract(old.e2e)
                self.span_outcomes.subtract(old.outcomes)
        if new_from > self.span_from:
            self.span_from = new_from
            # Drop zeroed keys so the sums stay as small as the live sample.
            self.span_ttft = +self.span_ttft
            self.span_e2e = +self.span_e2e
            self.span_outcomes = +self.span_outcomes
        if len(self.buckets) >= keep:
            for index in [i for i in self.buckets if i <= now_index - keep]:
                del self.buckets[index]

    def bucket(self, index: int) -> _Bucket:
        bucket = self.buckets.get(index)
        if bucket is None:
            bucket = self.buckets[index] = _Bucket(index)
        return bucket


class RollingWindow:
    def __init__(self, bucket_s: float = 2.0, keep_s: float = 600.0, span_s: float = 300.0) -> None:
        self.bucket_s = bucket_s
        self.keep = max(1, round(keep_s / bucket_s))
        self.span = max(1, min(self.keep, round(span_s / bucket_s)))
        self._lanes: dict[str, _Lane] = {}

    def _lane(self, name: str, now: float) -> tuple[_Lane, int]:
        lane = self._lanes.get(name)
        if lane is None:
            lane = self._lanes[name] = _Lane(now)
        index = int(now // self.bucket_s)
        lane.advance(index, self.keep, self.span, self.bucket_s)
        return lane, index

    def observe(
        self,
        lane_name: str,
        outcome: str,
        ttft_s: float | None,
        duration_s: float | None,
        now: float | None = None,
    ) -> None:
        now = time.monotonic() if now is None else now
        lane, index = self._lane(lane_name, now)
        bucket = lane.bucket(index)
        bucket.outcomes[outcome] += 1
        lane.span_outcomes[outcome] += 1
        if duration_s is not None:
            at = bin_of(duration_s)
            bucket.e2e[at] += 1
            lane.span_e2e[at] += 1
        if ttft_s is not None:
            at = bin_of(ttft_s)
            bucket.ttft[at] += 1
            lane.span_ttft[at] += 1

    def gauge(self, lane_name: str, slots_in_use: int, queue_depth: int, now: float) -> None:
        lane, index = self._lane(lane_name, now)
        bucket = lane.bucket(index)
        bucket.slots = max(bucket.slots or 0, slots_in_use)
        bucket.queue = max(bucket.queue or 0, queue_depth)

    def outcomes(self, lane_name: str, now: float) -> dict[str, int]:
        """Requests finished over the percentile span, by outcome."""
        lane, _ = self._lane(lane_name, now)
        return dict(+lane.span_outcomes)

    def lane_json(self, lane_name: str, now: float) -> dict[str, Any]:
        lane, index = self._lane(lane_name, now)
        rate_buckets = max(1, round(RATE_WINDOW_S / self.bucket_s))
        recent = sum(
            sum(b.outcomes.values())
            for i in range(index - rate_buckets + 1, index + 1)
            if (b := lane.buckets.get(i)) is not None
        )
        into_bucket = now - index * self.bucket_s
        # A lane seen for 10 s has a 10 s rate, not a sixth of one.
        covered = (rate_buckets - 1) * self.bucket_s + into_bucket
        rate_seconds = max(1.0, min(covered, now - lane.first_seen))
        series: dict[str, list[float | None]] = {}
        times: list[float] = []
        # Closed buckets only: a bucket still filling would show every rate dropping at "now".
        for i in range(index - self.keep + 1, index):
            bucket = lane.buckets.get(i)
            times.append(round(i * self.bucket_s - now, 3))
            if bucket is None:
                point: dict[str, float | None] = _EMPTY
            else:
                if bucket.summary is None:
                    bucket.summary = bucket.summarise(self.bucket_s)
                point = bucket.summary
            for key, value in point.items():
                series.setdefault(key, []).append(value)
        ttft = quantiles(lane.span_ttft)
        e2e = quantiles(lane.span_e2e)
        return {
            "rate_rps": round(recent / rate_seconds, 3),
            "outcomes": dict(+lane.span_outcomes),
            "ttft": _percentiles(ttft, sum(lane.span_ttft.values())),
            "e2e": _percentiles(e2e, sum(lane.span_e2e.values())),
            # Bucket starts as offsets from now (<= 0 s), oldest first.
            "series_t": times,
            "series": series,
        }


_EMPTY: dict[str, float | None] = {
    "rate": 0.0,
    "failed": 0.0,
    "ttft_p50": None,
    "ttft_p95": None,
    "e2e_p50": None,
    "e2e_p95": None,
    "slots": None,
    "queue": None,
}


def _percentiles(values: list[float | None], n: int) -> dict[str, float | None]:
    return {"p50": values[0], "p95": values[1], "p99": values[2], "n": n}
