"""Labelled metric children written directly: a counter's ``inc``, a gauge's ``inc``, ``dec``
and ``set`` and a histogram's ``observe`` on the child's own values, under their own locks,
without prometheus_client's per-call checks (four calls a counter, about a dozen counters and
histograms a request: the largest library share of the request path's profile). What a scrape
reads is the same values, so the exposition is byte-identical (tests/gateway/observe).

    direct(metric.labels(...)) -> the direct form, or the child itself (multiprocess values)
"""

from __future__ import annotations

from bisect import bisect_left

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.values import MutexValue


class _DirectCounter:
    """A counter child's ``inc`` on its value, under the value's own lock: prometheus_client's
    ``inc`` checks observability and the sign in two more calls first (four calls a counter,
    about a dozen counters and histograms a request: the largest library share of the profile)."""

    __slots__ = ("_value",)

    def __init__(self, value: MutexValue) -> None:
        self._value = value

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        value = self._value
        with value._lock:
            value._value += amount


class _DirectGauge:
    """A gauge child's ``inc``, ``dec`` and ``set`` on its value, as ``_DirectCounter``."""

    __slots__ = ("_value",)

    def __init__(self, value: MutexValue) -> None:
        self._value = value

    def inc(self, amount: float = 1) -> None:
        value = self._value
        with value._lock:
            value._value += amount

    def dec(self, amount: float = 1) -> None:
        value = self._value
        with value._lock:
            value._value -= amount

    def set(self, amount: float) -> None:
        value = self._value
        with value._lock:
            value._value = float(amount)


class _DirectHistogram:
    """A histogram child's ``observe``: the sum and the first bucket whose bound is at or above
    the amount (a bisection, where prometheus_client walks the bounds), each under its value's
    lock; an amount above every finite bound falls in +Inf, a NaN in none (as the library)."""

    __slots__ = ("_buckets", "_sum", "_upper_bounds")

    def __init__(self, child: Histogram) -> None:
        self._sum: MutexValue = child._sum
        self._buckets: list[MutexValue] = child._buckets
        self._upper_bounds: list[float] = child._upper_bounds

    def observe(self, amount: float) -> None:
        total = self._sum
        with total._lock:
            total._value += amount
        if amount != amount:  # noqa: PLR0124 - NaN (a comparison, not a call): below no bound
            return
        bucket = self._buckets[bisect_left(self._upper_bounds, amount)]
        with bucket._lock:
            bucket._value += 1


def direct(child: MetricWrapperBase) -> object:
    """The direct form of a labelled child whose values are in-process (``MutexValue``); any
    other (prometheus_client's multiprocess values) is its own child, unchanged."""
    if isinstance(child, Histogram):
        values = [child._sum, *child._buckets]
        if all(type(v) is MutexValue for v in values):
            return _DirectHistogram(child)
    elif type(getattr(child, "_value", None)) is MutexValue:
        if isinstance(child, Counter):
            return _DirectCounter(child._value)
        if isinstance(child, Gauge) and not child._is_most_recent:
            return _DirectGauge(child._value)
    return child
