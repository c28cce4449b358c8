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
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import orjson

from engine_pool.registry import EnginePool
from gateway.core.cancel import CancelScope
from gateway.core.count import TokenCount
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
from gateway.errors import (
    EngineUnreachable,
    GatewayError,
    NoHealthyCluster,
    PromptTooLong,
    ShuttingDown,
)
from gateway.observe.log import Logger, swallowed
from gateway.observe.metrics import Metrics
from gateway.observe.record import Record, Routed
from gateway.observe.recorder import Recorder
from gateway.protocols.openai import Prompt, RoutedRequest
from gateway.protocols.routes import EngineRoute
from gateway.request.admission import Admission
from gateway.request.context import RequestContext, Target
from gateway.request.endpoints import endpoint_chain, views_holding
from gateway.request.failover import Attempts, Failover
from gateway.request.forward import HEADER_COUNT_WAIT_S, Forwarder
from gateway.request.lanes import choose_lane, choose_named_lane, lane_tokens, no_lane_message
from gateway.request.migration import (
    IDS_FIELD,
    TOOLS_FIELD,
    Continuation,
    Diverged,
    Interrupted,
    by_text,
    cannot_migrate,
    continuation,
    untracked,
)
from gateway.request.pausing import Pauses, Sent
from gateway.request.policy import Policy
from gateway.request.prefix import Prefixes, Seen
from gateway.request.read import fresh_ids, read_request, request_id_from
from gateway.request.relay import Relay
from gateway.request.response_affinity import MemoryAffinity, ResponseAffinity, pin
from gateway.request.shadow_live import ShadowLive
from gateway.request.slot import Held
from gateway.request.want import want_of
from gateway.settings import LaneSettings
from gateway.upstream.proxy import Upstream


def _arrived(route: EngineRoute, scope: Scope) -> tuple[Record, str]:
    """A new request's record and its slot token, both ids from one random draw (a getrandom
    system call each when drawn apart)."""
    fresh, token = fresh_ids()
    return Record(request_id=request_id_from(scope, fresh), route=route.kind), token


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


def _relay(request: RoutedRequest, lane: LaneSettings, body: bytes) -> Relay | None:
    """The relay of a stream that may migrate, else None. Its token ids are asked for (of vLLM)
    unless the client named the field (then the client's choice stands, unblanked) or the
    request has tools: it would continue from its text anyway (the tool-call parser), and
    asked for ids vLLM sends the tokens its parser holds back as chunks of their own."""
    if untracked(request, lane) is not None:
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
        # What the pause rule sees in flight on each endpoint (lanes[].pause_reads).
        self.pauses = Pauses(self.log, self.metrics)
        self.accepting = True
        self.in_flight = 0
        # A candidate policy deciding beside this one (POST /admin/shadow); off by default.
        self.shadow = ShadowLive(pool, self.metrics, self.log, self.prefixes)

    def _tokens_of(self, model: str, prompt: Prompt) -> Sequence[int]:
        """The prompt's token ids as the engine gets them (prefix_index.source kv_events)."""
        return self.policy.counter.prompt_ids(model, prompt)

    async def handle(self, route: EngineRoute, scope: Scope, receive: Receive, send: Send) -> None:
        policy = self.policy
        record, token = _arrived(route, scope)
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
            # Asked once and handed on: in Python 3.11 every ``get_running_loop`` (and
            # ``current_task``, which asks for it) is a getpid system call, and a request's
            # cancel scopes, deadlines and body read all need it.
            loop = asyncio.get_running_loop()
            ctx = RequestContext(
                policy,
                route,
                scope,
                out,
                record,
                await read_body(
                    scope,
                    receive,
                    policy.settings.server.max_body_bytes,
                    policy.settings.server.body_timeout_s,
                    loop,
                ),
                loop=loop,
            )
            # A slot in a shared store is released under a shield (admission.py), which only
            # anyio's scope respects; an in-process store's release never awaits, and asyncio's
            # own cancellation (gateway/core/cancel.py) costs a fraction of anyio's.
            shielded = self.admission.store.shared
            with (
                anyio.CancelScope() if shielded else CancelScope(loop=loop) as cancel_on_disconnect
            ):
                # The connection's own callback where the server offers one (no task a
                # request); else a plain task, not an anyio task group: the group's spawn, its
                # cancel (anyio formats the task's repr into every cancel reason) and its exit
                # were among the largest per-request costs in the overhead profile.
                hook = disconnect_hook(scope)
                if hook is not None:
                    unwatch = hook(cancel_on_disconnect.cancel)
                else:
                    watcher = loop.create_task(
                        watch_disconnect(receive, cancel_on_disconnect.cancel)
                    )
                    watcher.add_done_callback(_reaper(self.log, self.metrics, record.request_id))
                    unwatch = _canceller(watcher)
                try:
                    await self._route(ctx, token)
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

    async def _route(self, ctx: RequestContext, token: str) -> None:
        """Steps 2 to 9 of one request, in order (README "Request lifecycle")."""
        await self._decide(ctx)  # 2-4: parse, count, the lane
        policy, record, out = ctx.policy, ctx.record, ctx.out
        request, model, lane, pinned = ctx.request, ctx.model, ctx.lane, ctx.pinned
        serving = tuple(c for c in ctx.decision.clusters if policy.serves(c, model.name))
        views_of = await views_holding(ctx, self.pool, serving)
        limit_of = policy.limit_of(lane)
        seen, order, candidates, chosen = endpoint_chain(  # 6
            ctx, self.prefixes, serving, views_of, limit_of
        )

        if pinned is not None and not any(v.state.routable for v in candidates()):
            raise NoHealthyCluster(
                f"the engine holding response '{request.previous_response_id}' ({pinned}) is "
                "down; its stored conversation lives only there",
                retry_after_s=5,
            )

        # One watch spans every attempt. A bound errs long: deadlines grown from it are never
        # shorter than the exact count's.
        ctx.watch = Watch(deadlines_for(lane.timeouts, ctx.exact.decided_by), ctx.loop)
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
        # 5: the slot. Its token (drawn with the request id: ``fresh_ids``) is ours, never the
        # client's request id: two requests sharing an id must not share (and free) one slot.
        async with self.admission.slot(lane, candidates, token, limit_of, ctx.want) as held:
            self.recorder.admitted(record, held.grant, chosen.get(held.grant.url))
            sent = self._send(ctx, seen, token, held.grant.url)
            try:
                while True:
                    target = Target(  # ``held.grant``: a failover or a migration moves it
                        held.grant,
                        policy.settings.cluster(held.grant.cluster),
                        policy.engine_keys.get(held.grant.cluster),
                        attempts.fresh,
                    )
                    try:
                        if await self._attempt(ctx, target, sent):  # 7-8: forward, relay
                            break
                    except EngineUnreachable as exc:
                        # Nothing reached the client: fail over (gateway/request/failover.py) or
                        # give up.
                        if not await self.failover.next_attempt(
                            record.request_id, held, exc, attempts, target.cluster
                        ):
                            raise
                        self.recorder.moved(record, held.grant, exc.reason)
                        sent = self._send(ctx, seen, token, held.url, sent)
                    except Interrupted as cut:
                        following = await self._migrate(ctx, cut, held, attempts)
                        if following is None:  # ends as before, the engine's error event too
                            if ctx.relay is not None and ctx.relay.held and not out.finished:
                                await out.body(ctx.relay.held, more=False)
                            raise cut.cause from None
                        ctx.sent, ctx.sent_path = following.body, following.path
                        self.recorder.migrated(record, held.grant, cut.reason, cut.cause)
                        sent = self._send(ctx, seen, token, held.url, sent)
                    except GatewayError as exc:
                        # The answer began and cannot migrate: said in the log, ended as before.
                        if record.status == 200 and (why := untracked(request, lane)):
                            self._refused_migration(ctx, why, exc, 0)
                        raise
            finally:
                self.prefixes.prefilled(token)
                self.pauses.left(sent)
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

    async def _attempt(self, ctx: RequestContext, target: Target, sent: Sent) -> bool:
        """One try at the target's endpoint; False when a cached question sent there paused
        it before its first byte (``lanes[].pause_reads``): it has waited until it may go on,
        its slot held, nothing relayed, and tries the same endpoint again."""
        with self.pauses.attempt(sent, ctx.loop) as attempt:
            await self.forwarder.attempt(ctx, target)
        if not attempt.paused:
            return True
        self.recorder.paused(ctx.record)
        await self.pauses.resumed(sent, ctx.watch)
        return False

    def _send(
        self, ctx: RequestContext, seen: Seen, token: str, url: str, previous: Sent | None = None
    ) -> Sent:
        """The request goes to ``url``: its uncached prompt is pending there (the prefill
        ledger) and in flight for the pause rule, which it may apply as a cached question
        (``lanes[].pause_reads``, gateway/request/pausing.py)."""
        done = self.prefixes.sending(seen, token, url)
        remaining = seen.tokens - seen.cached.get(url, 0)
        head = seen.hashes[0] if seen.hashes else None
        lane = ctx.lane
        sent = self.pauses.sent(token, ctx.request_id, lane.name, url, remaining, head, previous)

        def prefilled() -> None:  # its first chunk: past pausing
            done()
            sent.started = True

        ctx.prefilled = prefilled
        if lane.pause_reads is not None:
            self.pauses.ask(sent, lane.pause_reads.rule())
        return sent

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
        previous = ctx.request.previous_response_id
        ctx.decision, ctx.pinned = await pin(self.affinity, previous, decision, settings.lanes)
        ctx.want = want_of(ctx, self.pool)
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
