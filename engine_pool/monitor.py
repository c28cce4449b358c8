"""Background watch over every endpoint: one prober, one metrics scraper and one capability
check each.

Contract:
- ``EngineMonitor(pool, plans, on_event).run()`` runs until cancelled; ``plans`` give each
  endpoint its lane's probe interval, timeout and thresholds and its scrape interval.
- Work is per endpoint and per interval, never per request: a sweep costs O(endpoints) at the
  rate the lanes set, whatever the request rate.
- Everything the gateway should log or count comes out through ``on_event`` as plain data:
  ``StateChange`` (once per transition, with evidence), ``SlowProbe`` (alert class: it pages
  nobody and evicts nothing by itself), ``LoadRead``, ``ProbeFailed`` and ``ScrapeFailed``.
- A failed scrape says whether the engine is known alive (``engine_alive``): routable, and a
  probe succeeded since its scrapes began to fail. Only then is the failure unexpected (the
  engine answers but its /metrics does not); an engine that is down, or died a moment ago and
  is not yet caught by its prober, fails its scrapes as a matter of course.
- The capability check (engine_pool/capability.py) reads ``GET /v1/models`` at boot and every
  probe interval, with the KV capacity the scraper found in ``vllm:cache_config_info``, and
  holds it against the plan's ``needs`` (its lanes): ``CapabilityChange`` when the endpoint
  turns misconfigured or no longer is; ``CapabilityUnread`` when the engine did not answer.
- A scrape whose ``process_start_time_seconds`` (``Load.started_s``) differs from the
  endpoint's previous one means the engine's server process restarted between two scrapes,
  however quickly (its probes may never have failed): ``EngineRestarted`` once, before that
  scrape's ``LoadRead``. The first value read is no restart; an engine that stops exporting
  it keeps its last value, so exporting it again with the same start is none either.
- An endpoint that goes DOWN has its in-flight requests cancelled by the pool (see
  ``EnginePool.set_state``), so they end with an error and free their slots at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio
import httpx

from engine_pool.capability import LaneNeed, judge, parse_cache_config, parse_models
from engine_pool.cluster import EngineKind
from engine_pool.health import Prober, Thresholds, Verdict
from engine_pool.load import Load, Progress, parse_load
from engine_pool.registry import CapabilityChange, EnginePool, StateChange


@dataclass(frozen=True, slots=True)
class ProbePlan:
    cluster: str
    url: str
    kind: EngineKind
    health_path: str
    interval_s: float
    timeout_s: float
    thresholds: Thresholds
    scrape_interval_s: float
    # What the lanes routing to the endpoint ask of it, and the headers its /v1/models needs
    # (an engine started with an API key wants it there, unlike /health and /metrics).
    needs: tuple[LaneNeed, ...] = ()
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class SlowProbe:
    cluster: str
    url: str
    evidence: str


@dataclass(frozen=True, slots=True)
class LoadRead:
    cluster: str
    url: str
    load: Load


@dataclass(frozen=True, slots=True)
class ProbeFailed:
    cluster: str
    url: str
    evidence: str


@dataclass(frozen=True, slots=True)
class ScrapeFailed:
    cluster: str
    url: str
    error: BaseException
    engine_alive: bool


@dataclass(frozen=True, slots=True)
class EngineRestarted:
    cluster: str
    url: str
    # The server process's start times (Unix seconds) before and now.
    previous_started_s: float
    started_s: float


@dataclass(frozen=True, slots=True)
class CapabilityUnread:
    cluster: str
    url: str
    evidence: str


MonitorEvent = (
    StateChange
    | SlowProbe
    | LoadRead
    | ProbeFailed
    | ScrapeFailed
    | CapabilityChange
    | CapabilityUnread
    | EngineRestarted
)


def restarted(
    cluster: str, url: str, previous: float | None, started: float | None
) -> EngineRestarted | None:
    """A restart, when two start times read from the same endpoint differ (pure)."""
    if previous is None or started is None or started == previous:
        return None
    return EngineRestarted(cluster, url, previous, started)


class EngineMonitor:
    def __init__(
        self,
        pool: EnginePool,
        plans: Sequence[ProbePlan],
        on_event: Callable[[MonitorEvent], None],
    ) -> None:
        self._pool = pool
        self._plans = list(plans)
        self._on_event = on_event
        self._progress = {(p.cluster, p.url): Progress() for p in self._plans}
        # When each endpoint last answered a probe (monotonic seconds).
        self._probe_ok_at: dict[tuple[str, str], float] = {}
        # KV cache capacity (tokens) each engine's /metrics last reported, if it does.
        self._kv_tokens: dict[tuple[str, str], int | None] = {}
        # Each engine's server process start (Unix seconds), as its /metrics last said.
        self._started: dict[tuple[str, str], float] = {}

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=3 * len(self._plans) + 4)
        async with (
            httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=5.0)) as client,
            anyio.create_task_group() as tasks,
        ):
            for plan in self._plans:
                tasks.start_soon(self._probe_forever, client, plan)
                tasks.start_soon(self._scrape_forever, client, plan)
                tasks.start_soon(self._check_forever, client, plan)

    async def _check_forever(self, client: httpx.AsyncClient, plan: ProbePlan) -> None:
        url = plan.url.rstrip("/") + "/v1/models"
        key = (plan.cluster, plan.url)
        while True:
            try:
                with anyio.fail_after(plan.timeout_s):
                    response = await client.get(url, headers=dict(plan.headers))
                response.raise_for_status()
                capability = parse_models(response.json(), self._kv_tokens.get(key))
            except (httpx.HTTPError, TimeoutError, ValueError) as exc:
                # Down, or no /v1/models: what was known stays; routing is unchanged.
                self._pool.set_capability(plan.cluster, plan.url, None, None)
                evidence = f"{type(exc).__name__}: {exc}".rstrip(": ")
                self._on_event(CapabilityUnread(plan.cluster, plan.url, evidence))
            else:
                problem = judge(capability, plan.needs)
                change = self._pool.set_capability(plan.cluster, plan.url, capability, problem)
                if change is not None:
                    self._on_event(change)
            await anyio.sleep(plan.interval_s)

    async def _probe_forever(self, client: httpx.AsyncClient, plan: ProbePlan) -> None:
        progress = self._progress[(plan.cluster, plan.url)]

        def report(verdict: Verdict) -> None:
            if verdict.probe == "ok":
                self._probe_ok_at[(plan.cluster, plan.url)] = time.monotonic()
            elif verdict.probe == "failed":
                self._on_event(ProbeFailed(plan.cluster, plan.url, verdict.evidence))
            if verdict.alert is not None:
                self._on_event(SlowProbe(plan.cluster, plan.url, verdict.alert))
            change = self._pool.set_state(
                plan.cluster, plan.url, verdict.track.state, verdict.evidence
            )
            if change is not None:
                self._on_event(change)

        prober = Prober(
            url=plan.url.rstrip("/") + plan.health_path,
            interval_s=plan.interval_s,
            timeout_s=plan.timeout_s,
            limits=plan.thresholds,
            progressing=lambda: progress.advanced,
            report=report,
            pool_state=lambda: self._pool.state_of(plan.cluster, plan.url),
        )
        await prober.run(client)

    async def _scrape_forever(self, client: httpx.AsyncClient, plan: ProbePlan) -> None:
        progress = self._progress[(plan.cluster, plan.url)]
        url = plan.url.rstrip("/") + "/metrics"
        failing_since: float | None = None
        while True:
            try:
                with anyio.fail_after(max(plan.scrape_interval_s, 1.0)):
                    response = await client.get(url)
                response.raise_for_status()
                load = parse_load(plan.kind, response.text)
                if plan.kind == "vllm":
                    self._kv_tokens[(plan.cluster, plan.url)] = parse_cache_config(response.text)
            except (httpx.HTTPError, TimeoutError) as exc:
                progress.update(None)
                if failing_since is None:
                    failing_since = time.monotonic()
                probed = self._probe_ok_at.get((plan.cluster, plan.url), -1.0)
                alive = probed > failing_since and self._pool.routable(plan.cluster, plan.url)
                self._on_event(ScrapeFailed(plan.cluster, plan.url, exc, alive))
            else:
                failing_since = None
                progress.update(load.tokens_total)
                self._pool.set_load(
                    plan.cluster,
                    plan.url,
                    running=load.running,
                    waiting=load.waiting,
                    kv_usage=load.kv_usage,
                )
                key = (plan.cluster, plan.url)
                restart = restarted(plan.cluster, plan.url, self._started.get(key), load.started_s)
                if load.started_s is not None:
                    self._started[key] = load.started_s
                if restart is not None:
                    self._on_event(restart)
                self._on_event(LoadRead(plan.cluster, plan.url, load))
            await anyio.sleep(plan.scrape_interval_s)
