"""Every Prometheus metric the gateway exports, declared once, in a registry owned by the app.

Names and labels are part of the interface (dashboards and alert rules query them). There is no
module-level registry: each ``create_app`` builds its own ``Metrics`` so tests stay independent.
Histogram buckets span milliseconds to many minutes because a heavy lane's TTFT is minutes.
"""

from __future__ import annotations

from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from gateway.dashboard.events import EventRing
from gateway.dashboard.stats import RollingWindow

# 1 ms .. 30 min: fast-lane TTFT lives at the bottom, heavy-lane prefill at the top.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1200.0,
    1800.0,
)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (
    16,
    64,
    256,
    1024,
    2048,
    4096,
    8192,
    16384,
    32768,
    65536,
    131072,
    262144,
    524288,
    1048576,
)
OUTPUT_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 32768)
M = TypeVar("M", bound=MetricWrapperBase)
COUNT_BUCKETS = (0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "shapegate_requests",
            "Requests finished, by outcome.",
            ["lane", "cluster", "outcome"],
            registry=r,
        )
        self.route_decisions = Counter(
            "shapegate_route_decisions",
            "Routing decisions made.",
            ["lane", "reason", "count_method"],
            registry=r,
        )
        self.slots_in_use = Gauge(
            "shapegate_slots_in_use",
            "Slots held (this replica's view of the shared store).",
            ["lane", "cluster"],
            registry=r,
        )
        self.slots_limit = Gauge(
            "shapegate_slots_limit", "Slot limit.", ["lane", "cluster"], registry=r
        )
        self.queue_depth = Gauge(
            "shapegate_queue_depth", "Requests waiting for a slot.", ["lane"], registry=r
        )
        self.queue_wait = Histogram(
            "shapegate_queue_wait_seconds",
            "Time spent waiting for a slot.",
            ["lane"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Histogram(
            "shapegate_prompt_tokens",
            "Prompt tokens per request.",
            ["lane"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.output_tokens = Histogram(
            "shapegate_output_tokens",
            "Output tokens per request, where known.",
            ["lane"],
            buckets=OUTPUT_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "shapegate_ttft_seconds",
            "Time to first token, measured at the gateway.",
            ["lane", "cluster"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "shapegate_itl_seconds",
            "Gap between streamed chunks, measured at the gateway.",
            ["lane", "cluster"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "shapegate_e2e_seconds",
            "Request duration, admission to last byte.",
            ["lane", "cluster"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.count_seconds = Histogram(
            "shapegate_count_seconds",
            "Time to count a prompt's tokens.",
            ["method"],
            buckets=COUNT_BUCKETS,
            registry=r,
        )
        self.engine_up = Gauge(
            "shapegate_engine_up",
            "1 when the endpoint is routable.",
            ["cluster", "endpoint"],
            registry=r,
        )
        self.engine_load = Gauge(
            "shapegate_engine_load",
            "Load read from the engine's own metrics.",
            ["cluster", "endpoint", "what"],
            registry=r,
        )
        self.watchdog_events = Counter(
            "shapegate_watchdog_events",
            "Deadlines hit and slow-engine alerts.",
            ["lane", "cluster", "kind"],
            registry=r,
        )
        self.swallowed_errors = Counter(
            "shapegate_swallowed_errors",
            "Exceptions handled without re-raising.",
            ["where"],
            registry=r,
        )
        self.state_degraded = Gauge(
            "shapegate_state_degraded", "1 while the shared slot store is unreachable.", registry=r
        )
        # Failover (gateway/failover.py): retries before the response began, passive ejections.
        self.retries = Counter(
            "shapegate_retries",
            "Requests sent again before any response byte, by why the last attempt failed.",
            ["lane", "reason"],
            registry=r,
        )
        # Redis that lost its data (gateway/slots_redis.py): leases re-established by their owners.
        self.leases_restored = Counter(
            "shapegate_slot_leases_restored",
            "Leases in flight re-established after the shared store lost its data.",
            registry=r,
        )
        self.ejections = Counter(
            "shapegate_engine_ejections",
            "Endpoints marked down by what real requests saw (not by a probe).",
            ["cluster", "cause"],
            registry=r,
        )

        # Not Prometheus metrics: what the ops dashboard shows (swallowed errors and watchdog
        # events as a list; per-lane rates and percentiles over the last minutes). They hang
        # here because everything that reports those events already holds this object.
        self.events = EventRing()
        self.window = RollingWindow(self.events)

        self._children: dict[tuple[int, tuple[str, ...]], MetricWrapperBase] = {}

    def child(self, metric: M, *labels: str) -> M:
        """``metric.labels(*labels)`` (values in declaration order), remembered.

        prometheus_client validates and takes a lock on every ``labels`` call; the request path
        makes about ten a request (and one per streamed chunk). Label values come from the
        policy and a fixed set of outcomes, so this holds no more than the metrics' own children.
        """
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found  # type: ignore[return-value]

    def render(self) -> bytes:
        return generate_latest(self.registry)
