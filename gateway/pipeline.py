"""The request lifecycle, top to bottom (README "Request lifecycle" tells the same story).

``Pipeline.handle`` runs one proxied request: read the body, parse, count, choose the lane,
admit (slot), pick the endpoint, forward, relay, release, record. Each step is a call into its
own module; this file only wires them in order and turns every way a request can end into one
outcome:

    ok                 the engine's answer reached the client (any engine status below 500)
    upstream_error     the engine failed (5xx, refused, reset) and the client was told
    timeout            a watchdog deadline ended the request
    client_disconnect  the client left; its queue place or slot and upstream were released
    rejected           the gateway refused the request (bad input, lane full, no lane)
    error              a bug: logged with its traceback, counted, answered with a 500
    cancelled          cancelled from outside (the server stopped) before it could finish

Every request gets one ``route.decision`` (or ``route.rejected``) and one ``route.finished``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import orjson

from engine_pool.cluster import EngineView
from engine_pool.picker import order_endpoints
from engine_pool.registry import EnginePool
from gateway.admission import Admission, Grant
from gateway.auth import ClientAuth
from gateway.errors import (
    BadRequest,
    GatewayError,
    ModelNotFound,
    NoHealthyCluster,
    PromptTooLong,
    ShuttingDown,
    UpstreamError,
)
from gateway.exchange import (
    ClientGone,
    Outbound,
    Receive,
    Scope,
    Send,
    header,
    read_body,
    watch_disconnect,
)
from gateway.lanes import (
    Decision,
    choose_lane,
    choose_named_lane,
    exact_count_above,
    pin_to_cluster,
)
from gateway.log import Logger, swallowed
from gateway.metrics import Metrics
from gateway.protocol import RoutedRequest, prefix_key
from gateway.protocols.multipart import parse_multipart
from gateway.proxy import Upstream, response_headers, upstream_headers
from gateway.response_affinity import MemoryAffinity, ResponseAffinity, response_id_of
from gateway.routes import EngineRoute
from gateway.settings import ClusterSettings, LaneSettings, Settings
from gateway.tokens import TokenCount, TokenCounter
from gateway.trace import TraceWriter
from gateway.watchdog import DeadlineHit, Watch, deadlines_for

# A stream's first event (a Responses stream's carries the response id) is looked for this far.
LEARN_HEAD_BYTES = 65536


@dataclass(slots=True)
class Record:
    """What the decision log and the dashboard's ring keep about one request."""

    request_id: str
    endpoint: str
    started: float = field(default_factory=time.monotonic)
    fields: dict[str, Any] = field(default_factory=dict)
    # Until the request ends; a request cancelled from outside (server shutdown) ends "cancelled".
    outcome: str = "in_flight"
    in_ring: bool = False
    status: int = 0
    ttft_s: float | None = None
    output_tokens: int | None = None
    chunks: int = 0


def _first(group: BaseExceptionGroup[Any]) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def _reaper(log: Logger, metrics: Metrics, request_id: str) -> Callable[[asyncio.Task[None]], None]:
    """A done-callback for the disconnect watcher: a failure in it is logged, never lost."""

    def reap(task: asyncio.Task[None]) -> None:
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            swallowed(
                log,
                metrics,
                "pipeline.watch_disconnect",
                exc,
                "disconnect_unwatched",
                request_id=request_id,
            )

    return reap


def request_id_from(scope: Scope) -> str:
    given = header(scope, b"x-request-id")
    if given and len(given) <= 128 and given.isascii() and all(32 < b < 127 for b in given):
        return given.decode()
    return uuid.uuid4().hex


def _usage_tokens(payload: bytes) -> int | None:
    """Output tokens from a JSON body or the last SSE event that carries usage: OpenAI's
    ``completion_tokens``, or ``output_tokens`` (Responses, Anthropic)."""
    at = payload.rfind(b'"usage"')
    if at < 0:
        return None
    start = payload.rfind(b"{", 0, at)
    end = payload.find(b"\n", at)
    candidates = (payload, payload[start : end if end > 0 else None])
    for blob in candidates:
        try:
            usage = orjson.loads(blob.removeprefix(b"data: ")).get("usage") or {}
        except (orjson.JSONDecodeError, AttributeError):
            continue
        tokens = usage.get("completion_tokens", usage.get("output_tokens"))
        if isinstance(tokens, int):
            return tokens
    return None


@dataclass(frozen=True, slots=True)
class Policy:
    """What a request is admitted under: settings, tokenizers and engine keys, swapped whole on
    reload. A request reads the policy once, so it finishes under the one that admitted it."""

    settings: Settings
    counter: TokenCounter
    engine_keys: dict[str, str]
    auth: ClientAuth
    version: int = 1
    exact_above: int = field(init=False)
    forward_headers: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "exact_above", exact_count_above(self.settings.lanes))
        extra = frozenset(name.lower() for name in self.settings.routes.forward_headers)
        object.__setattr__(self, "forward_headers", extra)

    def serves(self, cluster: str, model: str) -> bool:
        models = self.settings.cluster(cluster).models
        return not models or model in models


class Pipeline:
    def __init__(
        self,
        policy: Policy,
        pool: EnginePool,
        admission: Admission,
        upstream: Upstream,
        metrics: Metrics,
        log: Logger,
        affinity: ResponseAffinity | None = None,
    ) -> None:
        self.policy = policy
        settings = policy.settings.routes
        self.affinity = affinity or MemoryAffinity(
            settings.response_affinity_entries, settings.response_affinity_ttl_s
        )
        self.pool = pool
        self.admission = admission
        self.upstream = upstream
        self.metrics = metrics
        self.log = log
        self.recent: deque[Record] = deque(maxlen=policy.settings.server.decision_ring_size)
        trace_file = policy.settings.state.trace_file
        self.trace = TraceWriter(Path(trace_file)) if trace_file else None
        self.accepting = True
        self.in_flight = 0

    async def handle(self, route: EngineRoute, scope: Scope, receive: Receive, send: Send) -> None:
        policy = self.policy
        record = Record(request_id=request_id_from(scope), endpoint=route.endpoint)
        out = Outbound(send, route.errors)
        ids = [(b"x-request-id", record.request_id.encode())]
        self.in_flight += 1
        try:
            if not self.accepting:
                raise ShuttingDown("gateway is shutting down", retry_after_s=1)
            policy.auth.check(header(scope, b"authorization"))
            body = await read_body(
                scope,
                receive,
                policy.settings.server.max_body_bytes,
                policy.settings.server.body_timeout_s,
            )
            with anyio.CancelScope() as cancel_on_disconnect:
                # A plain task, not an anyio task group: the group's spawn, its cancel (anyio
                # formats the task's repr into every cancel reason) and its exit were among the
                # largest per-request costs in the overhead benchmark's profile.
                watcher = asyncio.get_running_loop().create_task(
                    watch_disconnect(receive, cancel_on_disconnect.cancel)
                )
                watcher.add_done_callback(_reaper(self.log, self.metrics, record.request_id))
                try:
                    await self._route(policy, route, scope, body, out, record)
                finally:
                    watcher.cancel()
            # After the last byte, uvicorn reports the finished exchange as a disconnect too.
            if cancel_on_disconnect.cancelled_caught and not out.finished:
                record.outcome = "client_disconnect"
        except* ClientGone:
            record.outcome = "client_disconnect"
        except* GatewayError as refusal:
            exc = _first(refusal)
            assert isinstance(exc, GatewayError)
            self._fail(record, exc)
            await out.error(exc, ids)
        except* Exception as bug:  # the request boundary: a bug must not kill the server
            exc = _first(bug)
            self.log.exception("request.failed", request_id=record.request_id, exc_info=exc)
            swallowed(
                self.log,
                self.metrics,
                "pipeline.handle",
                exc,
                decision="answered_500",
                request_id=record.request_id,
            )
            record.outcome = "error"
            await out.error(GatewayError("internal gateway error"), ids)
        finally:
            self.in_flight -= 1
            self._finish(record, out)

    async def _route(
        self,
        policy: Policy,
        route: EngineRoute,
        scope: Scope,
        body: bytes,
        out: Outbound,
        record: Record,
    ) -> None:
        if route.parse is None:
            request = parse_multipart(route.endpoint, header(scope, b"content-type"), body)
        else:
            request = route.parse(body)
        settings = policy.settings
        model = settings.model(request.model)
        if model is None:
            raise ModelNotFound(f"The model `{request.model}` does not exist.", param="model")
        if model.max_model_len and (request.max_tokens or 0) >= model.max_model_len:
            raise BadRequest(
                f"'max_tokens' of {request.max_tokens} leaves no room for a prompt in the "
                f"model's context of {model.max_model_len} tokens",
                param="max_tokens",
            )
        healthy = self.pool.healthy_clusters()
        if route.multipart:  # no text to count: the lane the policy names
            count = TokenCount(0, "none", "none", 0, 0.0)
            decision = choose_named_lane(settings.multipart_lane, settings.lanes, healthy)
        else:
            count = await policy.counter.count(
                model.name, request.prompt, exact_above=policy.exact_above
            )
            decision = choose_lane(count.tokens, settings.lanes, healthy)
        decision, pinned = await self._pin(request, decision, settings.lanes)
        record.fields.update(self._decision_fields(request, count, decision, healthy))
        self._remember(record)
        if decision.lane is None:
            raise PromptTooLong(
                f"prompt of {count.tokens} tokens is above every lane's range "
                f"(largest {max(lane.max_prompt_tokens for lane in settings.lanes) - 1})",
                param="input_tokens",
            )
        if not decision.clusters:
            raise NoHealthyCluster(
                f"no healthy cluster for lane '{decision.lane.name}'", retry_after_s=5
            )
        lane = decision.lane
        serving = tuple(c for c in decision.clusters if policy.serves(c, model.name))

        affinity = (
            prefix_key(request.prompt, lane.affinity_prefix_bytes)
            if lane.prefix_affinity and not route.multipart
            else None
        )

        def candidates() -> Sequence[EngineView]:
            views = [v for c in serving for v in order_endpoints(self.pool.views(c), affinity)]
            return views if pinned is None else [v for v in views if v.url == pinned]

        if pinned is not None and not any(v.state.routable for v in candidates()):
            raise NoHealthyCluster(
                f"the engine holding response '{request.previous_response_id}' ({pinned}) is "
                "down; its stored conversation lives only there",
                retry_after_s=5,
            )

        # The slot token is ours, never the client's request id: two requests sharing an id
        # must not share (and free) one slot.
        async with self.admission.slot(lane, candidates, uuid.uuid4().hex) as grant:
            self._decided(record, grant, decision, count)
            with (
                anyio.CancelScope() as engine_down,
                self.pool.track(grant.cluster, grant.url, engine_down) as engine,
            ):
                cluster = settings.cluster(grant.cluster)
                await self._forward(
                    request,
                    route,
                    scope,
                    body,
                    grant,
                    lane,
                    cluster,
                    policy,
                    count,
                    out,
                    record,
                )
            if engine_down.cancelled_caught and not out.finished:
                raise UpstreamError(f"engine was marked down mid-request: {engine.evidence}")

    async def _pin(
        self, request: RoutedRequest, decision: Decision, lanes: Sequence[LaneSettings]
    ) -> tuple[Decision, str | None]:
        """A Responses follow-up goes to the endpoint that stored its previous response, when
        the gateway knows it; otherwise the count alone decides (the engine answers 404 for a
        response it does not hold)."""
        if request.previous_response_id is None:
            return decision, None
        found = await self.affinity.lookup(request.previous_response_id)
        if found is None:
            return decision, None
        pinned = pin_to_cluster(decision, found[0], lanes)
        return pinned, found[1] if pinned.reason == "response_affinity" else None

    async def _learn(self, request: RoutedRequest, grant: Grant, payload: bytes) -> None:
        """Remember which endpoint produced a Responses answer (its id is in the first bytes)."""
        if request.endpoint == "responses":
            response_id = response_id_of(payload)
            if response_id is not None:
                await self.affinity.remember(response_id, grant.cluster, grant.url)

    async def _forward(
        self,
        request: RoutedRequest,
        route: EngineRoute,
        scope: Scope,
        body: bytes,
        grant: Grant,
        lane: LaneSettings,
        cluster: ClusterSettings,
        policy: Policy,
        count: TokenCount,
        out: Outbound,
        record: Record,
    ) -> None:
        watch = Watch(deadlines_for(lane.timeouts, count.tokens))
        headers = upstream_headers(
            scope.get("headers", ()),
            record.request_id,
            forward_auth=cluster.forward_client_auth,
            engine_key=policy.engine_keys.get(cluster.name),
            extra=policy.forward_headers,
        )
        ours = {
            "x-request-id": record.request_id,
            "x-shapegate-lane": grant.lane,
            "x-shapegate-cluster": grant.cluster,
            "x-shapegate-prompt-tokens": str(count.tokens),
        }
        url = grant.url.rstrip("/") + route.path
        async with self.upstream.open(url, body, headers, watch) as response:
            record.status = response.status
            if not (request.stream and response.status == 200):
                payload = await response.read(watch)
                record.ttft_s = time.monotonic() - record.started
                record.output_tokens = _usage_tokens(payload)
                await out.start(
                    response.status, response_headers(response.headers, ours), streaming=False
                )
                if response.status == 200:  # stored before the client can see the id
                    await self._learn(request, grant, payload)
                await out.body(payload, more=False)
                record.outcome = "upstream_error" if record.status >= 500 else "ok"
            else:
                last, tail, head = 0.0, b"", b""
                learning = request.endpoint == "responses"
                async for chunk in response.chunks(watch):
                    now = time.monotonic()
                    if not out.started:
                        record.ttft_s = now - record.started
                        await out.start(
                            200, response_headers(response.headers, ours), streaming=True
                        )
                    else:
                        self.metrics.child(self.metrics.itl, grant.lane, grant.cluster).observe(
                            now - last
                        )
                    last = now
                    record.chunks += 1
                    tail = (tail + chunk)[-4096:]
                    if learning:  # the id is in the first event, which may span chunks
                        head += chunk
                        if b"\n\n" in head or len(head) > LEARN_HEAD_BYTES:
                            learning = False
                            await self._learn(request, grant, head)
                    await out.body(chunk, more=True)
                if not out.started:
                    await out.start(200, response_headers(response.headers, ours), streaming=True)
                await out.body(b"", more=False)
                record.outcome = "ok"
                record.output_tokens = _usage_tokens(tail)

    def _decision_fields(
        self,
        request: RoutedRequest,
        count: TokenCount,
        decision: Decision,
        healthy: dict[str, bool],
    ) -> dict[str, Any]:
        lane = decision.lane
        candidates = (*lane.clusters, *lane.emergency_clusters) if lane else ()
        return {
            "route": request.endpoint,
            "model": request.model,
            "stream": request.stream,
            "body_bytes": request.body_bytes,
            "prompt_bytes": count.prompt_bytes,
            "prompt_tokens": count.tokens,
            "count_method": count.method,
            "count_ms": round(count.seconds * 1000, 3),
            "tokenizer": count.tokenizer,
            "max_tokens": request.max_tokens,
            "lane": decision.lane_name,
            "reason": decision.reason,
            "cluster_health": {c: healthy.get(c, True) for c in candidates},
        }

    def _decided(self, record: Record, grant: Grant, decision: Decision, count: TokenCount) -> None:
        record.fields.update(
            cluster=grant.cluster, endpoint=grant.url, queue_wait_s=round(grant.queued_s, 4)
        )
        self.log.info("route.decision", request_id=record.request_id, **record.fields)
        self.metrics.child(
            self.metrics.route_decisions, grant.lane, decision.reason, count.method
        ).inc()
        self.metrics.child(self.metrics.queue_wait, grant.lane).observe(grant.queued_s)
        self.metrics.child(self.metrics.prompt_tokens, grant.lane).observe(count.tokens)

    def _fail(self, record: Record, exc: GatewayError) -> None:
        record.status = exc.status
        if isinstance(exc, DeadlineHit):
            record.outcome = "timeout"
            record.fields["deadline"] = exc.kind
            self.metrics.watchdog_events.labels(
                lane=record.fields.get("lane", "none"),
                cluster=record.fields.get("cluster", "none"),
                kind=exc.kind,
            ).inc()
        elif "cluster" in record.fields and exc.status >= 500:
            record.outcome = "upstream_error"
        else:
            record.outcome = "rejected"
        record.fields["error"] = exc.message
        if "cluster" not in record.fields:
            self.log.info(
                "route.rejected", request_id=record.request_id, status=exc.status, **record.fields
            )
            self._remember(record)

    def _remember(self, record: Record) -> None:
        if not record.in_ring:
            record.in_ring = True
            self.recent.append(record)

    def _finish(self, record: Record, out: Outbound) -> None:
        if record.outcome == "in_flight":
            record.outcome = "cancelled"
        duration = time.monotonic() - record.started
        lane = record.fields.get("lane", "none")
        cluster = record.fields.get("cluster", "none")
        record.fields["duration_s"] = round(duration, 4)
        self.log.info(
            "route.finished",
            request_id=record.request_id,
            lane=lane,
            cluster=cluster,
            outcome=record.outcome,
            status=out.status or record.status,
            ttft_s=None if record.ttft_s is None else round(record.ttft_s, 4),
            duration_s=round(duration, 4),
            output_tokens=record.output_tokens,
            chunks=record.chunks,
            # Why it ended, when not as planned: the error the client was told, the deadline hit.
            error=record.fields.get("error"),
            deadline=record.fields.get("deadline"),
        )
        self.metrics.child(self.metrics.requests, lane, cluster, record.outcome).inc()
        if "cluster" in record.fields:
            self.metrics.child(self.metrics.e2e, lane, cluster).observe(duration)
            if record.ttft_s is not None:
                self.metrics.child(self.metrics.ttft, lane, cluster).observe(record.ttft_s)
            if record.output_tokens is not None:
                self.metrics.child(self.metrics.output_tokens, lane).observe(record.output_tokens)
            if self.trace is not None:
                f = record.fields
                self.trace.record(
                    model=f["model"],
                    prompt_tokens=f["prompt_tokens"],
                    prompt_bytes=f["prompt_bytes"],
                    output_tokens=record.output_tokens or 0,
                    stream=f["stream"],
                    prompt_chars=None,
                    prefix=None,
                )
        self.metrics.window.observe(record)


def snapshot(records: Sequence[Record]) -> list[dict[str, Any]]:
    """The recent decisions, newest first, as plain JSON for the admin state and dashboard."""
    return [
        {
            "request_id": r.request_id,
            "endpoint": r.endpoint,
            "outcome": r.outcome,
            "status": r.status,
            "ttft_s": r.ttft_s,
            "output_tokens": r.output_tokens,
            **r.fields,
        }
        for r in reversed(records)
    ]
