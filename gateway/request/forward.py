"""Steps 7 and 8, forward and relay: one attempt at an endpoint, its answer to the client.

    Forwarder(pool, upstream, recorder, failover, affinity)
      attempt(ctx, target)    the request (``ctx.sent``) at the target's endpoint, counted in
                              flight there; its answer relayed as it arrives, or whole

An endpoint marked down (or drained past its deadline) cancels the attempt: ``EngineUnreachable``
before the answer began (the pipeline fails over), ``Interrupted`` after it for a stream relayed
for migration (the pipeline migrates it, gateway/request/migration.py), else ``UpstreamError``.
A non-streamed answer is relayed whole with its length; a stream, chunk by chunk (whole events
through the ``Relay`` of a stream that may migrate, gateway/request/relay.py). The engine's usage,
the TTFT and the outcome go to the request's record; a Responses answer's id is remembered for
its follow-ups.
"""

from __future__ import annotations

import time

from engine_pool.registry import EnginePool
from gateway.core.cancel import CancelScope
from gateway.core.decision import Grant
from gateway.core.watchdog import DeadlineHit
from gateway.count.usage import TAIL_MAX, EngineUsage, engine_usage, sse_events, trim_tail
from gateway.errors import EngineUnreachable, GatewayError, UpstreamError
from gateway.observe.recorder import Recorder
from gateway.request.context import RequestContext, Target
from gateway.request.failover import Failover
from gateway.request.migration import Diverged, Interrupted, asking_ids
from gateway.request.response_affinity import ResponseAffinity, response_id_of
from gateway.upstream.proxy import Upstream, UpstreamResponse, response_headers, upstream_headers

# How long the response headers may wait for the exact prompt count (finished while the engine
# worked; only a congested counting worker is still busy by then): the first byte is not held
# longer, and the header is then left out rather than filled with the bound.
HEADER_COUNT_WAIT_S = 0.05

# A stream's first event (a Responses stream's carries the response id) is looked for this far.
LEARN_HEAD_BYTES = 65536


def _cut(exc: GatewayError) -> str | None:
    """The migration reason of a failure mid-stream, or None: it ends the request as before."""
    if isinstance(exc, DeadlineHit):
        return None if exc.kind == "total" else exc.kind
    return "connection_lost" if isinstance(exc, UpstreamError) else None


class Forwarder:
    def __init__(
        self,
        pool: EnginePool,
        upstream: Upstream,
        recorder: Recorder,
        failover: Failover,
        affinity: ResponseAffinity,
    ) -> None:
        self.pool = pool
        self.upstream = upstream
        self.recorder = recorder
        self.failover = failover
        self.affinity = affinity

    async def attempt(self, ctx: RequestContext, target: Target) -> None:
        """One try at the target's endpoint, counted in flight there; an endpoint marked down
        (or drained past its deadline) cancels it: ``EngineUnreachable`` before the answer,
        ``Interrupted`` after it for a relayed stream (it migrates), else ``UpstreamError``."""
        grant = target.grant
        # asyncio's own cancellation (gateway/core/cancel.py): nothing inside is shielded.
        with (
            CancelScope(loop=ctx.loop) as engine_down,
            self.pool.track(grant.cluster, grant.url, engine_down) as engine,
        ):
            await self._forward(ctx, target)
        if not engine_down.cancelled_caught or ctx.out.finished:
            return
        if ctx.record.status == 0:
            raise EngineUnreachable(
                f"engine was marked down before answering: {engine.evidence}",
                reason="marked_down",
            )
        why = "drained" if engine.draining else "marked_down"
        down = UpstreamError(f"engine was {why.replace('_', ' ')} mid-request: {engine.evidence}")
        if ctx.relay is not None:
            raise Interrupted(down, why)
        raise down

    async def _forward(self, ctx: RequestContext, target: Target) -> None:
        request, record, out = ctx.request, ctx.record, ctx.out
        grant, exact, watch = target.grant, ctx.exact, ctx.watch
        headers = upstream_headers(
            ctx.scope.get("headers", ()),
            record.request_id,
            forward_auth=target.cluster.forward_client_auth,
            engine_key=target.engine_key,
            extra=ctx.policy.forward_headers,
            trace=self.recorder.attempt(record, grant.url),
        )
        # Our response headers, as bytes (names written once, not encoded a request).
        ours = [
            (b"x-request-id", record.request_id.encode("latin-1")),
            (b"x-shapegate-lane", grant.lane.encode("latin-1")),
            (b"x-shapegate-cluster", grant.cluster.encode("latin-1")),
        ]
        if exact.bound is not None:
            ours.append((b"x-shapegate-prompt-tokens-bound", b"%d" % exact.bound))
        url = grant.url.rstrip("/") + (ctx.sent_path or ctx.route.path)
        body = ctx.sent
        if ctx.relay is not None and ctx.relay.ask_ids and target.cluster.kind == "vllm":
            body = asking_ids(body)  # the exact context to continue from (migration.py)
        async with self.upstream.open(
            url,
            body,
            headers,
            watch,
            exact.meanwhile,
            fresh=target.fresh,
            whole=not request.stream,
        ) as response:
            record.status = response.status
            self.failover.answered(target.cluster, grant.url, response.status)
            if out.started and response.status != 200:  # a continuation the engine refused
                payload = await response.read(watch)
                raise UpstreamError(
                    f"engine answered {response.status} to a migrated stream's continuation: "
                    + payload[:200].decode("utf-8", "replace")
                )
            # Counted while the engine worked: done by now unless the counting worker is congested.
            tokens = await exact.tokens(HEADER_COUNT_WAIT_S)
            if tokens is not None:
                ours.append((b"x-shapegate-prompt-tokens", b"%d" % tokens))
            if not (request.stream and response.status == 200):
                payload = await response.read(watch)
                ctx.prefilled()  # the whole answer: past prefill (and pausing)
                record.ttft_s = time.monotonic() - record.started
                usage = engine_usage(payload)
                # A known length: framed by Content-Length, not chunked (HTTP/1.0 clients too).
                whole = [*ours, (b"content-length", b"%d" % len(payload))]
                await out.start(
                    response.status, response_headers(response.headers, whole), streaming=False
                )
                if response.status == 200:  # stored before the client can see the id
                    await self._learn(ctx, grant, payload)
                await out.body(payload, more=False)
                record.outcome = "upstream_error" if record.status >= 500 else "ok"
            else:
                usage = await self._stream(ctx, response, grant, ours)
            record.output_tokens = usage.completion_tokens
            record.engine_prompt_tokens = usage.prompt_tokens

    async def _stream(
        self,
        ctx: RequestContext,
        response: UpstreamResponse,
        grant: Grant,
        ours: list[tuple[bytes, bytes]],
    ) -> EngineUsage:
        """Relay a streamed answer as it arrives: unchanged, or, for a stream that may migrate,
        whole events through its ``Relay`` (``Interrupted`` when its engine fails mid-answer)."""
        request, record, out, relay = ctx.request, ctx.record, ctx.out, ctx.relay
        tail, events, head = b"", 0, b""
        learning = request.route == "responses"
        try:
            async for received in response.chunks(ctx.watch):
                if not events and not tail:  # this attempt's first chunk: prefilled
                    ctx.prefilled()
                self.recorder.chunk(record, time.monotonic())
                if not out.started:
                    await out.start(200, response_headers(response.headers, ours), streaming=True)
                # Whole events only through a relay, rewritten after a migration.
                chunk = received if relay is None else relay.feed(received)
                tail += chunk  # usage comes last; data events are counted in bulk
                if len(tail) > TAIL_MAX:
                    tail, passed = trim_tail(tail)
                    events += passed
                if learning:  # the id is in the first event, which may span chunks
                    head += chunk
                    if b"\n\n" in head or len(head) > LEARN_HEAD_BYTES:
                        learning = False
                        await self._learn(ctx, grant, head)
                if chunk:
                    await out.body(chunk, more=True)
                if relay is not None and relay.failure:
                    failed = UpstreamError("engine sent an error event mid-stream")
                    raise Interrupted(failed, "engine_error")
                if relay is not None and relay.diverged:
                    raise Diverged(UpstreamError("the replay did not repeat the answer relayed"))
        except (UpstreamError, DeadlineHit) as exc:
            reason = _cut(exc) if relay is not None else None
            if reason is None:
                raise
            raise Interrupted(exc, reason) from exc
        if relay is not None and (rest := relay.rest()):
            tail += rest
            await out.body(rest, more=True)
        if not out.started:
            await out.start(200, response_headers(response.headers, ours), streaming=True)
        await out.body(b"", more=False)
        record.outcome = "ok"
        usage = engine_usage(tail)
        events += sse_events(tail)
        if usage.completion_tokens is None and request.route in ("chat", "completions"):
            # No usage chunk: one token per content event (chat opens with a role event).
            record.output_tokens_estimate = max(0, events - (request.route == "chat"))
            if relay is not None and relay.migrations:  # every engine's share
                record.output_tokens_estimate = relay.so_far().tokens
        return usage

    async def _learn(self, ctx: RequestContext, grant: Grant, payload: bytes) -> None:
        """Remember which endpoint produced a Responses answer (its id is in the first bytes)."""
        if ctx.request.route == "responses":
            response_id = response_id_of(payload)
            if response_id is not None:
                await self.affinity.remember(response_id, grant.cluster, grant.url)
