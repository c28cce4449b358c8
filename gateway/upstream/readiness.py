"""Readiness: the boot probe as the first gate, then each lane's current truth.

The boot probe is proof that each lane really serves, not just that it is configured. At
start-up (and on ``POST /admin/probe``) one tiny real request (a one-token chat completion) goes
to each lane's primary clusters, trying their routable endpoints in order, with the lane's own
deadlines, then, if none answered, to its emergency clusters (the lane passes ``degraded``). A
lane passes when any endpoint answers 200 with choices. ``/readyz`` is 503 until every lane has
passed once, and says which lane failed and why. Lanes that failed are retried every ``RETRY_S``
until they pass. The probe bypasses the slot store: it is one request per lane, made before
traffic is admitted.

After it, ``lane_states`` (pure) tells each lane's state now, from the engine pool:

    ready      a primary cluster has a routable endpoint
    degraded   only an emergency cluster has one: the lane serves through it (still ready)
    down       no cluster of the lane has one: /readyz answers 503

with, per cluster, how many endpoints are routable and each endpoint's state and evidence, and
the lane's ``misconfigured`` endpoints (engine_pool/capability.py: routable, but their own
context or models fall short of the lane; shown as ``misconfigured: evidence``). The boot probe
waits for the monitor's first capability read (at most the lane's probe timeout) and names the
misconfigured endpoints in its detail; a lane they serve still passes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import orjson

from engine_pool.cluster import EngineState
from engine_pool.picker import order_endpoints
from engine_pool.registry import EnginePool
from gateway.core.watchdog import Watch, deadlines_for
from gateway.errors import GatewayError
from gateway.observe.log import Logger
from gateway.protocols.routes import path_of
from gateway.settings import LaneSettings, Settings
from gateway.upstream.proxy import Upstream

RETRY_S = 5.0
CAPABILITY_POLL_S = 0.05
LaneState = Literal["ready", "degraded", "down"]


@dataclass(frozen=True, slots=True)
class EndpointHealth:
    url: str
    state: EngineState
    evidence: str
    # Why the engine's own context or models fall short of its lanes (engine_pool/capability.py).
    misconfigured: str | None = None

    @property
    def shown(self) -> str:
        if self.misconfigured is not None and self.state.routable:
            return f"misconfigured: {self.misconfigured}"
        return f"{self.state.value}: {self.evidence}"


def lane_states(
    lanes: Sequence[LaneSettings], endpoints: Mapping[str, Sequence[EndpointHealth]]
) -> dict[str, dict[str, Any]]:
    """Each lane's state now and the evidence for it (see the module docstring)."""
    out: dict[str, dict[str, Any]] = {}
    for lane in lanes:
        clusters = {
            name: {
                "role": role,
                "routable": sum(e.state.routable for e in endpoints.get(name, ())),
                "endpoints": {e.url: e.shown for e in endpoints.get(name, ())},
            }
            for role, names in (("primary", lane.clusters), ("emergency", lane.emergency_clusters))
            for name in names
        }
        serving = [n for n in lane.clusters if clusters[n]["routable"]]
        state: LaneState = "ready"
        if not serving:
            serving = [n for n in lane.emergency_clusters if clusters[n]["routable"]]
            state = "degraded" if serving else "down"
        misconfigured = sorted(
            e.url
            for name in (*lane.clusters, *lane.emergency_clusters)
            for e in endpoints.get(name, ())
            if e.misconfigured is not None
        )
        out[lane.name] = {
            "state": state,
            "serving": serving,
            "clusters": clusters,
            "misconfigured": misconfigured,
        }
    return out


def endpoint_health(pool: EnginePool) -> dict[str, list[EndpointHealth]]:
    """The pool's endpoints by cluster, as ``lane_states`` reads them."""
    out: dict[str, list[EndpointHealth]] = {name: [] for name in pool.clusters}
    for engine in pool.engines():
        out[engine.cluster].append(
            EndpointHealth(engine.url, engine.state, engine.evidence, engine.misconfigured)
        )
    return out


@dataclass(frozen=True, slots=True)
class LaneCheck:
    lane: str
    passed: bool
    detail: str
    seconds: float
    at: float


class BootProbe:
    def __init__(
        self,
        settings: Settings,
        pool: EnginePool,
        upstream: Upstream,
        log: Logger,
        engine_keys: dict[str, str],
    ) -> None:
        self._settings = settings
        self._pool = pool
        self._upstream = upstream
        self._log = log
        self._keys = engine_keys
        self.checks: dict[str, LaneCheck] = {}
        self.passed_once: set[str] = set()

    def adopt(self, settings: Settings, engine_keys: dict[str, str]) -> None:
        """A reloaded policy: lanes that stay keep their results; new lanes are unprobed."""
        self._settings = settings
        self._keys = engine_keys
        names = {lane.name for lane in settings.lanes}
        self.passed_once &= names
        self.checks = {k: v for k, v in self.checks.items() if k in names}

    @property
    def ready(self) -> bool:
        return all(lane.name in self.passed_once for lane in self._settings.lanes)

    def why_not(self) -> dict[str, str]:
        return {
            lane.name: self.checks[lane.name].detail if lane.name in self.checks else "not probed"
            for lane in self._settings.lanes
            if lane.name not in self.passed_once
        }

    async def run(self) -> None:
        """Probe every lane once, concurrently."""
        async with anyio.create_task_group() as tasks:
            for lane in self._settings.lanes:
                tasks.start_soon(self._probe_lane, lane)

    async def run_until_ready(self) -> None:
        while True:
            await self.run()
            if self.ready:
                return
            await anyio.sleep(RETRY_S)

    async def _capability_read(self, lane: LaneSettings) -> list[str]:
        """Wait (at most the lane's probe timeout) until the monitor has read each endpoint's
        /v1/models once, then name the lane's misconfigured endpoints, with the evidence."""
        clusters = (*lane.clusters, *lane.emergency_clusters)
        keys = [(c, url) for c in clusters for url in self._settings.cluster(c).endpoints]
        for _ in range(int(lane.health.timeout_s / CAPABILITY_POLL_S) + 1):
            if all(self._pool.capability_read(c, url) for c, url in keys):
                break
            await anyio.sleep(CAPABILITY_POLL_S)  # the monitor's reads, not an event of ours
        return [
            f"{engine.url} misconfigured: {engine.misconfigured}"
            for engine in self._pool.engines()
            if engine.cluster in clusters and engine.misconfigured is not None
        ]

    async def _probe_lane(self, lane: LaneSettings) -> None:
        started = time.monotonic()
        misconfigured = await self._capability_read(lane)
        failures: list[str] = []
        passed = False
        for name in (*lane.clusters, *lane.emergency_clusters):
            cluster = self._settings.cluster(name)
            model = cluster.models[0] if cluster.models else self._settings.models[0].name
            body = orjson.dumps(
                {
                    "model": model,
                    "max_tokens": 1,
                    "stream": False,
                    "messages": [{"role": "user", "content": "ping"}],
                }
            )
            endpoints = order_endpoints(self._pool.views(name))
            if not endpoints:
                why = ", ".join(
                    f"{e.url} {e.state.value}: {e.evidence}"
                    for e in self._pool.engines()
                    if e.cluster == name
                )
                failures.append(f"cluster {name}: no routable endpoint ({why})")
            for view in endpoints:
                problem = await self._one(lane, view.url, body, self._keys.get(name))
                if problem is None:
                    passed = True
                    break
                failures.append(f"{view.url}: {problem}")
            if passed:
                break
        seconds = time.monotonic() - started
        detail = "ok" if passed else "; ".join(failures) or "no cluster"
        if passed and name not in lane.clusters:
            detail = f"degraded: served by emergency cluster {name}; " + "; ".join(failures)
        if misconfigured:  # it serves, but not every prompt it admits: the operator must know
            detail = "; ".join([detail, *misconfigured])
        self.checks[lane.name] = LaneCheck(lane.name, passed, detail, seconds, time.time())
        if passed:
            self.passed_once.add(lane.name)
        log = self._log.info if passed else self._log.warning
        log("lane.probed", lane=lane.name, passed=passed, detail=detail, seconds=round(seconds, 3))

    async def _one(self, lane: LaneSettings, url: str, body: bytes, key: str | None) -> str | None:
        headers = {
            "content-type": "application/json",
            "x-request-id": f"shapegate-probe-{lane.name}",
        }
        if key:
            headers["authorization"] = f"Bearer {key}"
        watch = Watch(deadlines_for(lane.timeouts, 1))
        try:
            async with self._upstream.open(
                url.rstrip("/") + path_of("chat"), body, headers, watch
            ) as response:
                payload = await response.read(watch)
        except GatewayError as exc:
            return exc.message
        if response.status != 200:
            return f"HTTP {response.status}: {payload[:200].decode(errors='replace')}"
        try:
            choices = orjson.loads(payload).get("choices")
        except (orjson.JSONDecodeError, AttributeError):
            return "answer is not an OpenAI JSON body"
        return None if choices else "answer has no choices"
