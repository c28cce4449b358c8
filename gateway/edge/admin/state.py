"""The dashboard's JSON state, built at a bounded rate however many pages poll it.

Contract:
- ``build_state(gateway)`` reads one consistent-enough snapshot: per lane, slots in use against
  the limit (the shared store's count, and this replica's split by cluster), queue depth and
  oldest wait, and the rolling window's rates, percentiles and series; per cluster and endpoint,
  health state, evidence, load and in-flight; the newest decisions; swallowed errors and
  watchdog events (the ring's details and the Prometheus counters' totals, which also count
  what never reached the ring). It samples the lanes' gauges into the rolling window.
- ``borrowing_state(admission, lane)`` is a lane's borrowing (whom it lends to, what it borrows
  and lends now, its reserved endpoints), in this state and in ``/admin/state``.
- A shared slot store that cannot answer does not break the page: slot counts become ``null``
  and the failure is reported once per outage through ``swallowed``.
- ``StateCache.get()`` rebuilds at most once per ``min_interval_s`` and hands every caller in
  between the same bytes, so ten open dashboards cost what one does.
- Client-controlled strings (model names, request ids) are cut short here and rendered with
  ``textContent`` by the page, never as HTML.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

import anyio
import orjson
from prometheus_client import Metric

from gateway.core.slots import endpoint_key, lane_key
from gateway.errors import GatewayError
from gateway.observe.log import swallowed

if TYPE_CHECKING:
    from gateway.edge.services import Gateway
    from gateway.observe.record import Record
    from gateway.request.admission import Admission
    from gateway.settings import LaneSettings

MAX_DECISIONS = 500
MAX_TEXT = 120
# Fields of ``Record.as_json()`` the table shows; anything else stays in the log.
DECISION_FIELDS = (
    "request_id",
    "endpoint_kind",
    "outcome",
    "status",
    "ttft_s",
    "output_tokens",
    "output_tokens_estimate",
    "model",
    "stream",
    "body_bytes",
    "prompt_tokens",
    "prompt_tokens_bound",
    "engine_prompt_tokens",
    "count_drift",
    "count_method",
    "count_ms",
    "max_tokens",
    "lane",
    "reason",
    "lender",
    "priority",
    "cluster",
    "endpoint",
    "queue_wait_s",
    "duration_s",
    "deadline",
    "error",
)


def _short(value: Any) -> Any:
    return value[:MAX_TEXT] if isinstance(value, str) else value


def decision_row(record: Record, wall_now: float, mono_now: float) -> dict[str, Any]:
    # A record joins the ring when its lane is decided, long before it finishes.
    data = record.as_json()
    row = {key: _short(data[key]) for key in DECISION_FIELDS}
    row.update(
        at=round(wall_now - (mono_now - record.started), 3),
        age_s=None if record.finished else round(mono_now - record.started, 3),
    )
    return row


def _counter_totals(metric_families: Iterable[Metric], label: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    for family in metric_families:
        for sample in family.samples:
            if sample.name.endswith("_total"):
                key = sample.labels.get(label, "")
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


class StoreWatch:
    """Reports a failing shared store once per outage, not once per refresh."""

    def __init__(self) -> None:
        self.failing = False


async def _slots(gateway: Gateway, watch: StoreWatch) -> dict[str, int] | None:
    keys = [lane_key(lane.name) for lane in gateway.settings.lanes] + [
        endpoint_key(e.cluster, e.url) for e in (*gateway.pool.engines(), *gateway.pool.retired())
    ]
    try:
        used = await gateway.store.in_use(keys)
    except GatewayError as exc:
        if not watch.failing:
            swallowed(
                gateway.log, gateway.metrics, "dashboard.state", exc, decision="slots_shown_unknown"
            )
        watch.failing = True
        return None
    watch.failing = False
    return used


def _sample(gateway: Gateway, name: str, **labels: str) -> float | None:
    return gateway.metrics.registry.get_sample_value(name, labels)


def borrowing_state(admission: Admission, lane: LaneSettings) -> dict[str, object]:
    """A lane's borrowing as admin state and the dashboard show it: whom it lends to and on
    what terms, what it borrows now (by lender), what others borrow from it, and its endpoints
    reserved for its own waiting requests."""
    rule = lane.lend
    return {
        "lends": None
        if rule is None
        else {
            "to": list(rule.to),
            "max_prompt_tokens": rule.max_prompt_tokens,
            "max_tokens": rule.max_tokens,
            "per_endpoint": rule.per_endpoint,
            "max_drain_s": rule.max_drain_s,
        },
        "borrowing": {
            lender: n for (name, lender), n in admission.borrowing.items() if name == lane.name
        },
        "lent": {
            borrower: n
            for (borrower, lender), n in admission.borrowing.items()
            if lender == lane.name
        },
        "reserved_endpoints": {
            key: waited
            for key, waited in admission.reserved().items()
            if any(key.startswith(f"ep:{c}:") for c in lane.clusters)
        },
    }


async def build_state(gateway: Gateway, watch: StoreWatch | None = None) -> dict[str, Any]:
    settings, metrics, window = gateway.settings, gateway.metrics, gateway.recorder.window
    mono_now, wall_now = time.monotonic(), time.time()
    used = await _slots(gateway, watch or StoreWatch())
    lanes = []
    for lane in settings.lanes:
        in_use = used[lane_key(lane.name)] if used is not None else None
        depth = gateway.admission.queue_depth(lane.name)
        clusters = []
        local = 0.0
        for name in (*lane.clusters, *lane.emergency_clusters):
            labels = {"lane": lane.name, "cluster": name}
            here = _sample(gateway, "shapegate_slots_in_use", **labels)
            local += here or 0.0
            clusters.append(
                {
                    "name": name,
                    "emergency": name in lane.emergency_clusters,
                    "slots_in_use": here,
                    "slot_limit": _sample(gateway, "shapegate_slots_limit", **labels),
                }
            )
        window.gauge(lane.name, int(local) if in_use is None else in_use, depth, mono_now)
        lanes.append(
            {
                "name": lane.name,
                "min_prompt_tokens": lane.min_prompt_tokens,
                "max_prompt_tokens": lane.max_prompt_tokens,
                "on_full": lane.on_full,
                "slots_in_use": in_use,
                "slot_limit": lane.slots.lane,
                "per_endpoint_limit": lane.slots.per_endpoint,
                "queue_depth": depth,
                "queue_limit": lane.queue.depth,
                "queue_max_wait_s": lane.queue.max_wait_s,
                "oldest_wait_s": round(gateway.admission.oldest_wait_s(lane.name), 3),
                "clusters": clusters,
                **borrowing_state(gateway.admission, lane),
                **window.lane_json(lane.name, mono_now),
            }
        )
    clusters_out: list[dict[str, Any]] = []
    for name, cluster in gateway.pool.clusters.items():
        endpoints = []
        for url in cluster.endpoints:
            engine = gateway.pool.engine(name, url)
            slots = used[endpoint_key(name, url)] if used is not None else None
            endpoints.append({**engine.as_json(wall_now), "slots_in_use": slots})
        clusters_out.append({"name": name, "kind": cluster.kind, "endpoints": endpoints})
    for engine in gateway.pool.retired():  # removed by a reload, still serving: draining
        key = endpoint_key(engine.cluster, engine.url)
        row = {**engine.as_json(wall_now), "slots_in_use": used[key] if used is not None else None}
        found = [c for c in clusters_out if c["name"] == engine.cluster]
        if found:
            found[0]["endpoints"].append(row)
        else:
            clusters_out.append({"name": engine.cluster, "kind": engine.kind, "endpoints": [row]})
    recent = list(gateway.recorder.recent)[-MAX_DECISIONS:]
    return {
        "generated_at": wall_now,
        "started_at": gateway.started_at,
        "policy_version": gateway.pipeline.policy.version,
        "accepting": gateway.pipeline.accepting,
        "in_flight": gateway.pipeline.in_flight,
        "state_backend": settings.state.backend,
        "state_degraded": bool(_sample(gateway, "shapegate_state_degraded")),
        "slots_known": used is not None,
        "window": {"bucket_s": window.bucket_s, "span_s": window.span * window.bucket_s},
        "lanes": lanes,
        "unrouted": window.outcomes("none", mono_now),
        "clusters": clusters_out,
        "decisions": [decision_row(r, wall_now, mono_now) for r in reversed(recent)],
        "events": metrics.events.recent(),
        # Our exact prompt counts against the engines' usage: a badge when they disagree.
        "count_drift": gateway.recorder.drift.as_json(),
        "totals": {
            "swallowed": _counter_totals(metrics.swallowed_errors.collect(), "where"),
            "watchdog": _counter_totals(metrics.watchdog_events.collect(), "kind"),
        },
        **_worker(gateway),
    }


def _worker(gateway: Gateway) -> dict[str, Any]:
    if gateway.group is None:
        return {}
    return {"worker": {"index": gateway.group.index, "pid": os.getpid()}}


class StateCache:
    def __init__(
        self, build: Callable[[], Awaitable[dict[str, Any]]], min_interval_s: float = 0.5
    ) -> None:
        self._build = build
        self._min_interval_s = min_interval_s
        self._lock = anyio.Lock()
        self._body: bytes | None = None
        self._at = 0.0

    def _fresh(self) -> bytes | None:
        if self._body is not None and time.monotonic() - self._at < self._min_interval_s:
            return self._body
        return None

    async def get(self) -> bytes:
        body = self._fresh()
        if body is not None:
            return body
        async with self._lock:
            body = self._fresh()
            if body is None:
                body = orjson.dumps(await self._build())
                self._body, self._at = body, time.monotonic()
        return body
