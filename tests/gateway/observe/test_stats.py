"""The dashboard's rolling window, event ring and admin decision, as plain data (no sockets)."""

from __future__ import annotations

import math
import random
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from gateway.edge.admin.guard import AdminRequest, admin_access
from gateway.observe.events import EventRing
from gateway.observe.stats import RollingWindow, bin_of, bin_value, quantiles


def done(
    lane: str = "fast", outcome: str = "ok", ttft: float | None = 0.1, duration: float = 0.5
) -> dict[str, Any]:
    """One finished request, as the recorder hands it to the window."""
    return {"lane_name": lane, "outcome": outcome, "ttft_s": ttft, "duration_s": duration}


def exact_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


@given(st.lists(st.floats(min_value=2e-4, max_value=5e4), min_size=1, max_size=300))
def test_binned_quantiles_are_within_two_percent_of_exact(values: list[float]) -> None:
    bins: Any = {}
    for v in values:
        bins[bin_of(v)] = bins.get(bin_of(v), 0) + 1
    from collections import Counter

    got = quantiles(Counter(bins))
    for q, value in zip((0.5, 0.95, 0.99), got, strict=True):
        assert value is not None
        assert math.isclose(value, exact_rank(values, q), rel_tol=0.021)


def test_bins_are_monotonic_and_cover_milliseconds_to_hours() -> None:
    assert bin_of(0) == bin_of(1e-5) == 0
    edges = [bin_of(v) for v in (0.001, 0.01, 0.1, 1, 10, 100, 3600, 7200)]
    assert edges == sorted(edges) and len(set(edges)) == len(edges)
    assert bin_of(3600) < 450  # an hour fits the ~450 bins the docstring promises
    assert math.isclose(bin_value(bin_of(123.4)), 123.4, rel_tol=0.021)
    assert quantiles(__import__("collections").Counter()) == [None, None, None]


def test_window_percentiles_forget_what_left_the_span() -> None:
    window = RollingWindow(bucket_s=2, keep_s=60, span_s=10)
    t0 = 1000.0
    for _ in range(50):
        window.observe(**done(ttft=5.0, duration=6.0), now=t0)
    early = window.lane_json("fast", now=t0 + 1)
    assert early["ttft"]["n"] == 50 and math.isclose(early["ttft"]["p50"], 5.0, rel_tol=0.021)
    for _ in range(10):
        window.observe(**done(ttft=0.05, duration=0.2), now=t0 + 8)
    mixed = window.lane_json("fast", now=t0 + 9)
    assert mixed["ttft"]["n"] == 60
    assert math.isclose(mixed["ttft"]["p50"], 5.0, rel_tol=0.021)
    # The slow burst is now older than the 10 s span: only the fast requests remain.
    later = window.lane_json("fast", now=t0 + 13)
    assert later["ttft"]["n"] == 10 and later["e2e"]["n"] == 10
    assert math.isclose(later["ttft"]["p99"], 0.05, rel_tol=0.021)
    assert later["outcomes"] == {"ok": 10}
    gone = window.lane_json("fast", now=t0 + 30)
    assert gone["ttft"] == {"p50": None, "p95": None, "p99": None, "n": 0}
    assert gone["outcomes"] == {}


def test_series_hold_closed_buckets_with_rates_percentiles_and_gauges() -> None:
    window = RollingWindow(bucket_s=2, keep_s=20, span_s=10)
    t0 = 2000.0
    for i in range(8):
        window.observe(**done(ttft=0.2, duration=1.0), now=t0 + i * 0.25)
    window.observe(**done(outcome="timeout", ttft=None, duration=3.0), now=t0 + 1)
    window.gauge("fast", slots_in_use=3, queue_depth=1, now=t0 + 0.5)
    window.gauge("fast", slots_in_use=7, queue_depth=0, now=t0 + 1.5)
    window.gauge("fast", slots_in_use=2, queue_depth=4, now=t0 + 2.5)
    out = window.lane_json("fast", now=t0 + 4.5)
    series, t = out["series"], out["series_t"]
    assert len(t) == 9 and t == sorted(t) and t[-1] <= 0
    first = t.index(-4.5)  # the bucket that started at t0
    assert series["rate"][first] == 9 / 2 and series["failed"][first] == 1 / 2
    assert math.isclose(series["ttft_p50"][first], 0.2, rel_tol=0.021)
    assert series["slots"][first] == 7 and series["queue"][first] == 1
    assert series["slots"][first + 1] == 2 and series["queue"][first + 1] == 4
    assert series["rate"][0] == 0 and series["ttft_p50"][0] is None
    # A lane seen for 4.5 s has a 4.5 s rate, not a 60 s one.
    assert math.isclose(out["rate_rps"], 9 / 4.5)


def test_memory_is_bounded_whatever_the_rate() -> None:
    window = RollingWindow(bucket_s=1, keep_s=30, span_s=10)
    rng = random.Random(3)
    for i in range(20_000):
        now = 5000 + i * 0.01
        window.observe(
            **done(ttft=rng.lognormvariate(-2, 2), duration=rng.lognormvariate(0, 2)), now=now
        )
    lane = window._lanes["fast"]
    assert len(lane.buckets) <= 30
    assert all(len(b.ttft) < 450 and len(b.e2e) < 450 for b in lane.buckets.values())
    assert len(lane.span_ttft) < 450


def test_event_ring_is_bounded_but_totals_count_everything() -> None:
    ring = EventRing(size=3)
    for i in range(5):
        ring.add("swallowed", "x", f"boom {i}", "kept_going", {"n": i, "obj": object()})
    ring.add("swallowed", "y", "z" * 5000, None, {"where": "spoofed", "blob": "b" * 5000})
    events = ring.recent()
    assert len(events) == 3 and ring.totals["swallowed"] == 6
    assert events[0]["where"] == "y" and len(events[0]["message"]) == 300
    assert "where" not in events[0]["fields"] and len(events[0]["fields"]["blob"]) == 300
    assert events[1]["message"] == "boom 4" and events[1]["fields"]["n"] == 4
    assert isinstance(events[1]["fields"]["obj"], str)


def test_admin_access_decisions() -> None:
    def ask(path: str, client: str | None, auth: str | None, token: str | None) -> Any:
        req = AdminRequest(path, client_host=client, host="localhost:8000", authorization=auth)
        return admin_access(req, token)

    open_paths = ("/v1/chat/completions", "/metrics", "/healthz", "/administrator", "/dashboards")
    for path in open_paths:
        assert ask(path, "203.0.113.9", None, None).allow
        assert ask(path, "203.0.113.9", None, "t" * 20).allow
    assert ask("/admin/state", "127.0.0.1", None, None).allow
    assert ask("/admin/state", "127.9.9.9", None, None).allow
    assert not ask("/admin/state", None, None, None).allow
    assert not ask("/admin/state", "testclient", None, None).allow
    assert ask("/dashboard", "10.0.0.1", None, None).status == 403
    token = "t" * 20
    assert ask("/admin", "127.0.0.1", None, token).status == 401
    assert ask("/admin/x", "10.0.0.1", f"bearer {token}", token).allow
    assert ask("/admin/x", "10.0.0.1", f"Bearer  {token} ", token).allow
    assert ask("/admin/x", "10.0.0.1", "Bearer ", token).status == 401
    assert ask("/dashboard/static/app.js", "10.0.0.1", None, token).allow
