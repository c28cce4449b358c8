"""The gateway's side of watching engines: probe plans from the lane policy, and what the
monitor's events become in logs and metrics.

A cluster is probed with the health settings of the lane(s) it serves. When it serves several
(primary in one, emergency in another), the most lenient settings win: a heavy engine must never
be judged by a fast lane's clock.

Events become: ``engine.state_changed`` (once per transition, with evidence: a warning when the
engine goes down or is ``misconfigured``, info otherwise) and ``shapegate_engine_up``, an
endpoint going down also passed on (``on_down``: the approximate prefix index forgets it); the
state ``misconfigured`` when an endpoint's own /v1/models (or KV cache) cannot hold what its lanes
admit, and back to ``up`` when it can, with ``shapegate_engine_misconfigured`` and
``shapegate_engine_misconfigurations_total``; ``engine.restarted`` (a warning, with the old
and new process start times) and ``shapegate_engine_restarts_total`` when an engine's
``process_start_time_seconds`` changed, the restart also passed on (``on_restart``: the prefix
index forgets what it believed that engine held); ``engine.slow`` (a warning and
``watchdog_events{kind=probe_timeout}``, an alert that evicts nothing); load gauges. Every
failed probe, scrape and /v1/models read counts in
``shapegate_engine_check_failures_total{cluster, endpoint, check}``: an engine failing is the
engine's news (its state change is logged once), not an error of ours. Only a scrape failing
while the engine is known alive (it answers probes) is unexpected: that one is also a swallowed
error, logged when the endpoint's scrapes start failing, not on every interval.

``watch_latency`` judges, every ``JUDGE_INTERVAL_S``, each endpoint's request latencies against
its cluster's peers (engine_pool/latency.py): ``engine.slow_requests`` (warning, with evidence)
when one turns slow, ``engine.slow_recovered`` when it no longer is, ``shapegate_engine_slow``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import anyio

from engine_pool.capability import LaneNeed
from engine_pool.health import Thresholds
from engine_pool.latency import judge
from engine_pool.monitor import (
    CapabilityUnread,
    EngineRestarted,
    LoadRead,
    MonitorEvent,
    ProbeFailed,
    ProbePlan,
    ScrapeFailed,
    SlowProbe,
)
from engine_pool.registry import CapabilityChange, EnginePool, StateChange
from gateway.observe.log import Logger, swallowed
from gateway.observe.metrics import Metrics
from gateway.settings import ClusterSettings, HealthSettings, LaneSettings, Settings


def lanes_of(settings: Settings, cluster: str) -> list[LaneSettings]:
    return [
        lane
        for lane in settings.lanes
        if cluster in lane.clusters or cluster in lane.emergency_clusters
    ]


def _lenient(healths: list[HealthSettings]) -> HealthSettings:
    if not healths:
        return HealthSettings()
    return HealthSettings(
        interval_s=min(h.interval_s for h in healths),
        timeout_s=max(h.timeout_s for h in healths),
        down_after_timeouts=max(h.down_after_timeouts for h in healths),
        up_after_successes=max(h.up_after_successes for h in healths),
        scrape_interval_s=min(h.scrape_interval_s for h in healths),
    )


def lane_needs(settings: Settings, cluster: ClusterSettings) -> tuple[LaneNeed, ...]:
    """What the lanes that route to ``cluster`` as a primary ask of its engines (an emergency
    cluster is a stand-in by design: per-request routing alone keeps from it what it cannot
    hold)."""
    names = cluster.models or tuple(m.name for m in settings.models)
    models = tuple(
        (model.name, *model.aliases)
        for model in (settings.model(name) for name in names)
        if model is not None
    )
    return tuple(
        LaneNeed(lane.name, lane.max_prompt_tokens - 1, lane.min_output_tokens, models)
        for lane in settings.lanes
        if cluster.name in lane.clusters
    )


def probe_plans(settings: Settings, keys: Mapping[str, str] | None = None) -> list[ProbePlan]:
    """One plan per endpoint; ``keys``: engine API keys by cluster (for its /v1/models)."""
    plans = []
    for cluster in settings.clusters:
        health = _lenient([lane.health for lane in lanes_of(settings, cluster.name)])
        needs = lane_needs(settings, cluster)
        key = (keys or {}).get(cluster.name)
        headers = (("authorization", f"Bearer {key}"),) if key else ()
        for url in cluster.endpoints:
            plans.append(
                ProbePlan(
                    cluster=cluster.name,
                    url=url,
                    kind=cluster.kind,
                    health_path=cluster.health_path,
                    interval_s=health.interval_s,
                    timeout_s=health.timeout_s,
                    thresholds=Thresholds(health.down_after_timeouts, health.up_after_successes),
                    scrape_interval_s=health.scrape_interval_s,
                    needs=needs,
                    headers=headers,
                )
            )
    return plans


def slow_start(log: Logger, cluster: str, url: str, window_s: float, why: str) -> None:
    """One ``engine.slow_start``: the endpoint's admission ramps up over ``window_s``."""
    log.info("engine.slow_start", cluster=cluster, endpoint=url, window_s=window_s, why=why)


class EngineEvents:
    """Turns monitor events into log lines and metrics; ``on_down(url)`` is told of every
    endpoint that goes down (its engine may restart, and what it cached with it), and
    ``on_restart(url)`` of every engine that restarted (its cache is empty)."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        log: Logger,
        pool: EnginePool | None = None,
        on_down: Callable[[str], None] | None = None,
        on_restart: Callable[[str], None] | None = None,
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        self._log = log
        self._on_down = on_down
        self._on_restart = on_restart
        self._failing: set[tuple[str, str]] = set()
        # The gauges start from what the pool knows (a reload keeps a down or misconfigured
        # endpoint's state, whose change will not be reported again), else up and fine.
        for cluster in settings.clusters:
            for url in cluster.endpoints:
                up, wrong = True, False
                if pool is not None and pool.has(cluster.name, url):
                    engine = pool.engine(cluster.name, url)
                    up, wrong = engine.state.routable, engine.misconfigured is not None
                metrics.engine_up.labels(cluster=cluster.name, endpoint=url).set(up)
                metrics.engine_misconfigured.labels(cluster=cluster.name, endpoint=url).set(wrong)

    def __call__(self, event: MonitorEvent) -> None:
        if isinstance(event, StateChange):
            # An engine leaving routing is an operator's news (a warning); back up, or slow but
            # routable, is information.
            emit = self._log.info if event.new.routable else self._log.warning
            emit(
                "engine.state_changed",
                cluster=event.cluster,
                endpoint=event.url,
                old=event.old.value,
                new=event.new.value,
                evidence=event.evidence,
            )
            self._metrics.engine_up.labels(cluster=event.cluster, endpoint=event.url).set(
                1 if event.new.routable else 0
            )
            if event.new.routable and event.slow_start_s > 0:
                slow_start(self._log, event.cluster, event.url, event.slow_start_s, "recovered")
            if not event.new.routable and self._on_down is not None:
                self._on_down(event.url)
        elif isinstance(event, CapabilityChange):
            self._log.warning(
                "engine.state_changed",
                cluster=event.cluster,
                endpoint=event.url,
                old="up" if event.misconfigured else "misconfigured",
                new="misconfigured" if event.misconfigured else "up",
                evidence=event.evidence,
            )
            self._metrics.engine_misconfigured.labels(
                cluster=event.cluster, endpoint=event.url
            ).set(1 if event.misconfigured else 0)
            if event.misconfigured:
                self._metrics.engine_misconfigurations.labels(
                    cluster=event.cluster, endpoint=event.url
                ).inc()
        elif isinstance(event, EngineRestarted):
            # A warning: nobody asked for it, and whatever it held (its prefix cache, requests
            # in flight at the time) is gone, possibly between two probes.
            self._log.warning(
                "engine.restarted",
                cluster=event.cluster,
                endpoint=event.url,
                previous_started_s=event.previous_started_s,
                started_s=event.started_s,
            )
            self._metrics.engine_restarts.labels(cluster=event.cluster, endpoint=event.url).inc()
            if self._on_restart is not None:
                self._on_restart(event.url)
        elif isinstance(event, CapabilityUnread):
            self._metrics.engine_check_failures.labels(
                cluster=event.cluster, endpoint=event.url, check="models"
            ).inc()
        elif isinstance(event, SlowProbe):
            lanes = lanes_of(self._settings, event.cluster)
            lane = lanes[0].name if lanes else "none"
            self._log.warning(
                "engine.slow",
                cluster=event.cluster,
                endpoint=event.url,
                lane=lane,
                evidence=event.evidence,
            )
            self._metrics.watchdog_events.labels(
                lane=lane, cluster=event.cluster, kind="probe_timeout"
            ).inc()
            self._metrics.events.add(
                "watchdog",
                "engine.probe",
                event.evidence,
                "alert_only",
                {"lane": lane, "cluster": event.cluster, "endpoint": event.url},
            )
        elif isinstance(event, LoadRead):
            self._failing.discard((event.cluster, event.url))
            for what in ("running", "waiting", "kv_usage"):
                value = getattr(event.load, what)
                if value is not None:
                    self._metrics.engine_load.labels(
                        cluster=event.cluster, endpoint=event.url, what=what
                    ).set(value)
        elif isinstance(event, ProbeFailed):
            self._metrics.engine_check_failures.labels(
                cluster=event.cluster, endpoint=event.url, check="probe"
            ).inc()
        elif isinstance(event, ScrapeFailed):
            self._metrics.engine_check_failures.labels(
                cluster=event.cluster, endpoint=event.url, check="scrape"
            ).inc()
            key = (event.cluster, event.url)
            if not event.engine_alive:
                # Down, or dead a moment ago and not yet caught by its prober: expected.
                return
            if key in self._failing:
                self._metrics.swallowed_errors.labels(where="load.scrape").inc()
            else:
                self._failing.add(key)
                swallowed(
                    self._log,
                    self._metrics,
                    "load.scrape",
                    event.error,
                    decision="route_without_load",
                    cluster=event.cluster,
                    endpoint=event.url,
                )


# How often endpoints' request latencies are judged against their peers (O(samples) a round).
JUDGE_INTERVAL_S = 5.0


def judge_latency(pool: EnginePool, metrics: Metrics, log: Logger) -> None:
    """One round: each endpoint's TTFT p95 and slow state from the requests it served."""
    for (cluster, url), latency in judge(pool.latency, time.monotonic()).items():
        if pool.set_latency(cluster, url, latency):
            if latency.slow is not None:
                log.warning(
                    "engine.slow_requests", cluster=cluster, endpoint=url, evidence=latency.slow
                )
            else:
                log.info("engine.slow_recovered", cluster=cluster, endpoint=url)
        metrics.engine_slow.labels(cluster=cluster, endpoint=url).set(latency.slow is not None)


async def watch_latency(pool: EnginePool, metrics: Metrics, log: Logger) -> None:
    """``judge_latency`` every ``JUDGE_INTERVAL_S``; slow is reported, routing is unchanged."""
    while True:
        await anyio.sleep(JUDGE_INTERVAL_S)
        judge_latency(pool, metrics, log)
