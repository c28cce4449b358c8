"""The gateway's side of watching engines: probe plans from the lane policy, and what the
monitor's events become in logs and metrics.

A cluster is probed with the health settings of the lane(s) it serves. When it serves several
(primary in one, emergency in another), the most lenient settings win: a heavy engine must never
be judged by a fast lane's clock.

Events become: ``engine.state_changed`` (info, once per transition, with evidence) and
``shapegate_engine_up``; ``engine.slow`` (a warning and ``watchdog_events{kind=probe_timeout}``,
an alert that evicts nothing); load gauges; a failed scrape is counted every time and logged
when an endpoint's scrapes start failing, not on every interval.
"""

from __future__ import annotations

from engine_pool.cluster import Cluster
from engine_pool.health import Thresholds
from engine_pool.monitor import LoadRead, MonitorEvent, ProbePlan, ScrapeFailed, SlowProbe
from engine_pool.registry import StateChange
from gateway.log import Logger, swallowed
from gateway.metrics import Metrics
from gateway.settings import HealthSettings, LaneSettings, Settings


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


def pool_clusters(settings: Settings) -> list[Cluster]:
    """The engine pool's view of the configured clusters."""
    return [
        Cluster(
            name=c.name,
            kind=c.kind,
            endpoints=c.endpoints,
            models=c.models,
            slow_start_s=c.outlier.slow_start_s,
        )
        for c in settings.clusters
    ]


def probe_plans(settings: Settings) -> list[ProbePlan]:
    plans = []
    for cluster in settings.clusters:
        health = _lenient([lane.health for lane in lanes_of(settings, cluster.name)])
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
                )
            )
    return plans


def slow_start(log: Logger, cluster: str, url: str, window_s: float, why: str) -> None:
    """One ``engine.slow_start``: the endpoint's admission ramps up over ``window_s``."""
    log.info("engine.slow_start", cluster=cluster, endpoint=url, window_s=window_s, why=why)


class EngineEvents:
    """Turns monitor events into log lines and metrics."""

    def __init__(self, settings: Settings, metrics: Metrics, log: Logger) -> None:
        self._settings = settings
        self._metrics = metrics
        self._log = log
        self._failing: set[tuple[str, str]] = set()
        for cluster in settings.clusters:
            for url in cluster.endpoints:
                metrics.engine_up.labels(cluster=cluster.name, endpoint=url).set(1)

    def __call__(self, event: MonitorEvent) -> None:
        if isinstance(event, StateChange):
            self._log.info(
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
        elif isinstance(event, ScrapeFailed):
            key = (event.cluster, event.url)
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
