"""Every Prometheus metric the gateway exports, declared once, in a registry owned by the app.

Names and labels are part of the interface (dashboards and alert rules query them). There is no
module-level registry: each ``create_app`` builds its own ``Metrics`` so tests stay independent.
Latency buckets span a millisecond to the longest deadline of the policy's lanes
(``Metrics(deadlines)``, every lane's first-byte, idle and total deadline, each a bucket edge,
so the top bucket is at or above the longest ``total_s``); a heavy lane's TTFT is minutes.
TTFT, e2e and in-flight carry the endpoint (the policy's endpoints: a bounded label set).
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterable, Iterator
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from prometheus_client import Metric

from gateway.observe.direct import direct
from gateway.observe.events import EventRing

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
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)
M = TypeVar("M", bound=MetricWrapperBase)


def latency_buckets(deadlines: Iterable[float] = ()) -> tuple[float, ...]:
    """The base buckets plus every lane deadline: a request that ran to its lane's total_s is
    counted below +Inf, and a deadline hit falls on a bucket edge."""
    return tuple(sorted({*LATENCY_BUCKETS, *deadlines}))


def status_class(status: int) -> str:
    return f"{status // 100}xx" if 100 <= status < 600 else "none"


class _InFlight(Collector):
    """``shapegate_endpoint_in_flight``, read from the pool at scrape time (no per-request cost)."""

    def __init__(self, read: Callable[[], Iterable[tuple[str, str, int]]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "shapegate_endpoint_in_flight",
            "Requests in flight on each endpoint (this replica).",
            labels=["cluster", "endpoint"],
        )
        for cluster, endpoint, n in self._read():
            family.add_metric([cluster, endpoint], n)
        yield family


class _ShadowDecisions(Collector):
    """``shapegate_shadow_decisions_total``, read from its dict at scrape time, after
    ``before`` (the shadow's flush of the requests it has queued: the scrape counts them)."""

    def __init__(self, counts: dict[tuple[str, str], int]) -> None:
        self._counts = counts
        self.before: Callable[[], None] | None = None

    def collect(self) -> Iterator[Metric]:
        if self.before is not None:
            self.before()
        family = CounterMetricFamily(
            "shapegate_shadow_decisions",
            "Live requests a shadow policy decided too, by the active lane and the shadow's.",
            labels=["lane", "shadow_lane"],
        )
        for (lane, shadow_lane), n in sorted(self._counts.items()):
            family.add_metric([lane, shadow_lane], n)
        yield family


# Engine's prompt count minus ours: 0 when tokenizer and template match the engine's.
DRIFT_BUCKETS = (-256, -64, -16, -8, -4, -2, -1, 0, 1, 2, 4, 8, 16, 64, 256)
COUNT_BUCKETS = (0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)


class Metrics:
    def __init__(self, deadlines: Iterable[float] = ()) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        latency = latency_buckets(deadlines)
        self.requests = Counter(
            "shapegate_requests",
            "Requests finished, by outcome and the status class the client got.",
            ["lane", "cluster", "outcome", "status_class"],
            registry=r,
        )
        self.build_info = Gauge(
            "shapegate_build_info",
            "Always 1; the labels say what runs.",
            ["version", "python"],
            registry=r,
        )
        self.build_info.labels(version=_version(), python=platform.python_version()).set(1)
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
        self.borrowed = Counter(
            "shapegate_borrowed",
            "Requests granted a slot on another lane's idle engine (gateway/request/borrowing.py).",
            ["lane", "lender"],
            registry=r,
        )
        # shapegate_shadow_decisions_total{lane, shadow_lane}: (active lane, shadow lane) ->
        # live requests a shadow policy decided too (gateway/request/shadow_live.py). A plain
        # dict the request path adds to, exported at scrape time (a labelled counter's lock and
        # lookup per request were a third of the shadow's cost).
        self.shadow_decisions: dict[tuple[str, str], int] = {}
        self.shadow_scrape = _ShadowDecisions(self.shadow_decisions)
        r.register(self.shadow_scrape)
        self.borrowers_in_flight = Gauge(
            "shapegate_borrowers_in_flight",
            "Borrowed requests running on a lending lane's engines.",
            ["lane", "lender"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "shapegate_queue_wait_seconds",
            "Time spent waiting for a slot.",
            ["lane"],
            buckets=latency,
            registry=r,
        )
        self.prompt_tokens = Histogram(
            "shapegate_prompt_tokens",
            "Prompt tokens per request, counted exactly (never the byte bound).",
            ["lane"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.output_tokens = Histogram(
            "shapegate_output_tokens",
            "Output tokens per request: the engine's usage, else one per SSE content event.",
            ["lane", "source"],
            buckets=OUTPUT_BUCKETS,
            registry=r,
        )
        # Per endpoint (one label more, no observation more): a slow engine shows in its own
        # series; sum by lane or cluster for the lane's view.
        self.ttft = Histogram(
            "shapegate_ttft_seconds",
            "Time to first token, measured at the gateway.",
            ["lane", "cluster", "endpoint"],
            buckets=latency,
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
            ["lane", "cluster", "endpoint"],
            buckets=latency,
            registry=r,
        )
        self.tpot = Histogram(
            "shapegate_tpot_seconds",
            "Time per output token after the first, of streamed requests.",
            ["lane"],
            buckets=TPOT_BUCKETS,
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
        self.count_drift = Histogram(
            "shapegate_count_drift_tokens",
            "Engine's usage.prompt_tokens minus the gateway's exact count, per request.",
            ["model", "route"],
            buckets=DRIFT_BUCKETS,
            registry=r,
        )
        self.engine_slow = Gauge(
            "shapegate_engine_slow",
            "1 while the endpoint's TTFT or time per token is an outlier among its peers.",
            ["cluster", "endpoint"],
            registry=r,
        )
        self.engine_misconfigured = Gauge(
            "shapegate_engine_misconfigured",
            "1 while the endpoint's own context or served models fall short of its lanes.",
            ["cluster", "endpoint"],
            registry=r,
        )
        self.engine_misconfigurations = Counter(
            "shapegate_engine_misconfigurations",
            "Times the endpoint turned misconfigured for its lanes.",
            ["cluster", "endpoint"],
            registry=r,
        )
        self.engine_restarts = Counter(
            "shapegate_engine_restarts",
            "Times the endpoint's engine restarted (its process_start_time_seconds changed).",
            ["cluster", "endpoint"],
            registry=r,
        )
        self.engine_check_failures = Counter(
            "shapegate_engine_check_failures",
            "Failed health probes and metrics scrapes (an engine's failures, not the gateway's).",
            ["cluster", "endpoint", "check"],
            registry=r,
        )
        self.state_degraded = Gauge(
            "shapegate_state_degraded", "1 while the shared slot store is unreachable.", registry=r
        )
        # Failover (gateway/request/failover.py): retries before the response began, passive
        # ejections.
        self.retries = Counter(
            "shapegate_retries",
            "Requests sent again before any response byte, by why the last attempt failed.",
            ["lane", "reason"],
            registry=r,
        )
        # Mid-stream migration (gateway/request/migration.py): outcome migrated, refused (a
        # request it cannot continue safely), exhausted (max_migrations reached) or failed (no
        # endpoint took it in time).
        self.migrations = Counter(
            "shapegate_migrations",
            "Streams whose engine failed after the answer began, by what became of them.",
            ["lane", "outcome"],
            registry=r,
        )
        # Reads paused for a cached question on their engine (lanes[].pause_reads,
        # gateway/request/pausing.py).
        self.paused = Counter(
            "shapegate_route_paused",
            "Requests paused before their first byte for a cached question on their endpoint.",
            ["lane"],
            registry=r,
        )
        # Redis that lost its data (gateway/slots/redis_store.py): leases re-established by their
        # owners.
        self.leases_restored = Counter(
            "shapegate_slot_leases_restored",
            "Leases in flight re-established after the shared store lost its data.",
            registry=r,
        )
        # The prefix index (engine_pool/prefix_index.py, gateway/request/prefix.py).
        self.prefix_index_blocks = Gauge(
            "shapegate_prefix_index_blocks",
            "(block, endpoint) entries the prefix index holds (at most prefix_index.max_blocks).",
            registry=r,
        )
        self.kv_events_blocks = Gauge(
            "shapegate_kv_events_blocks",
            "Blocks an engine reports holding in its KV events (prefix_index.source kv_events).",
            ["endpoint"],
            registry=r,
        )
        self.kv_events_lag = Gauge(
            "shapegate_kv_events_lag_seconds",
            "From an engine's newest KV event batch (its timestamp) to when the index applied it.",
            ["endpoint"],
            registry=r,
        )
        self.kv_events_rebuilds = Counter(
            "shapegate_kv_events_rebuilds",
            "Times an engine's blocks were forgotten and rebuilt (restart, unreplayable gap).",
            ["endpoint"],
            registry=r,
        )
        self.prefix_index_oldest = Gauge(
            "shapegate_prefix_index_oldest_seconds",
            "Age of the prefix index's oldest entry: how far back it remembers (<= ttl_s).",
            registry=r,
        )
        self.ejections = Counter(
            "shapegate_engine_ejections",
            "Endpoints marked down by what real requests saw (not by a probe).",
            ["cluster", "cause"],
            registry=r,
        )

        # Not a Prometheus metric: the swallowed errors and watchdog events the ops dashboard
        # lists. It hangs here because everything that reports those events already holds this
        # object. (The per-lane rolling window belongs to gateway/observe/recorder.py's Recorder.)
        self.events = EventRing()

        self._children: dict[tuple[MetricWrapperBase, tuple[str, ...]], object] = {}

    def child(self, metric: M, *labels: str) -> M:
        """``metric.labels(*labels)`` (values in declaration order), remembered, and for a
        counter, gauge or histogram its direct form (gateway/observe/direct.py): ``inc``,
        ``dec``, ``set`` and ``observe`` as the child's own, on the same values.

        prometheus_client validates and takes a lock on every ``labels`` call; the request path
        makes about ten a request (and one per streamed chunk). Label values come from the
        policy and a fixed set of outcomes, so this holds no more than the metrics' own children.
        """
        key = (metric, labels)  # a metric hashes by identity: no id() call
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = direct(metric.labels(*labels))
        return found  # type: ignore[return-value]

    def watch_in_flight(self, read: Callable[[], Iterable[tuple[str, str, int]]]) -> None:
        """Export per-endpoint in-flight counts, read by ``read`` at each scrape."""
        self.registry.register(_InFlight(read))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _version() -> str:
    try:
        return version("shapegate")
    except PackageNotFoundError:
        return "unknown"
