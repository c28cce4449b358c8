"""Request tracing (gateway/observe/tracing.py) through real sockets: the spans a routed, a
rejected and a failed-over request leave, the traceparent the engine receives, no prompt text in
any span, nothing at all with tracing off, and an unreachable collector that never touches a
request."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import generate_latest
from structlog.testing import capture_logs

from gateway.count.tokens import TokenCounter
from gateway.edge.app import ShapegateApp, create_app
from gateway.observe.log import get_logger
from gateway.observe.metrics import Metrics
from gateway.observe.tracing import GuardedExporter, Tracing, otlp_exporter
from gateway.settings import ConfigError, TracingSettings, parse_settings
from tests.conftest import JSON, lanes_config
from tests.gateway.request.test_failover import (
    QUIET_PROBER,
    engine_that_dies,
    first_probe,
    ordered_ports,
)
from tests.support.fake_engine import FakeEngine
from tests.support.prom import parse
from tests.support.servers import free_port, serve_asgi

CANARY = "canary-7f3a9c-do-not-export"
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
CLIENT_HEADERS = {
    **JSON,
    "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
    "tracestate": "congo=t61rcWkgMzE",
}


def chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": "qwen3.6",
        "messages": [{"role": "user", "content": f"say {CANARY} back"}],
        "max_tokens": 3,
        **extra,
    }


def hexid(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def traced(
    config: dict[str, Any], counter: TokenCounter
) -> tuple[ShapegateApp, InMemorySpanExporter]:
    """A gateway whose spans go to an in-memory exporter as each one ends."""
    config = {**config, "tracing": {"enabled": True}}
    app = create_app(parse_settings(config, environ={}), counter)
    memory = InMemorySpanExporter()
    app.gateway.recorder.tracing = Tracing.build(TracingSettings(enabled=True), memory, batch=False)
    return app, memory


@asynccontextmanager
async def gateway(app: ShapegateApp) -> AsyncIterator[tuple[str, httpx.AsyncClient]]:
    async with serve_asgi(app) as url, httpx.AsyncClient(timeout=10) as client:
        await first_probe(client, url)
        yield url, client


def by_kind(spans: tuple[ReadableSpan, ...], kind: SpanKind) -> list[ReadableSpan]:
    return [s for s in spans if s.kind == kind]


def assert_no_canary(spans: tuple[ReadableSpan, ...]) -> None:
    for span in spans:
        assert CANARY not in span.name
        for value in (span.attributes or {}).values():
            assert CANARY not in str(value)
        for event in span.events:
            assert CANARY not in str(event.attributes)


def fast_config(endpoints: list[str], **lane: Any) -> dict[str, Any]:
    config = lanes_config(endpoints, ["http://127.0.0.1:9"])
    config["lanes"][0]["health"] = QUIET_PROBER
    config["lanes"][0].update(lane)
    return config


async def one_traced_request(
    counter: TokenCounter, headers: dict[str, str], rid: str
) -> tuple[FakeEngine, str, InMemorySpanExporter, httpx.Response]:
    """One chat request through a traced gateway to a fake engine; 200 expected."""
    engine = FakeEngine()
    async with serve_asgi(engine) as engine_url:
        app, memory = traced(fast_config([engine_url]), counter)
        async with gateway(app) as (url, client):
            answer = await client.post(
                url + "/v1/chat/completions", json=chat(), headers={**headers, "x-request-id": rid}
            )
            assert answer.status_code == 200
    return engine, engine_url, memory, answer


async def test_a_routed_request_is_a_child_of_the_clients_trace_and_so_is_the_engines(
    counter: TokenCounter,
) -> None:
    engine, engine_url, memory, answer = await one_traced_request(counter, CLIENT_HEADERS, "t1")
    spans = memory.get_finished_spans()
    (server,) = spans  # one span a request
    assert server.kind == SpanKind.SERVER
    # The span continues the client's trace; the engine gets a child context of it: the
    # client's trace id, our span as parent, the client's tracestate.
    assert hexid(server.context.trace_id, 32) == CLIENT_TRACE
    assert server.parent is not None and hexid(server.parent.span_id, 16) == CLIENT_SPAN
    sent = engine.seen["t1"].headers
    assert sent["traceparent"] == (f"00-{CLIENT_TRACE}-{hexid(server.context.span_id, 16)}-01")
    assert sent["tracestate"] == "congo=t61rcWkgMzE"
    attrs = dict(server.attributes or {})
    assert server.name == "POST /v1/chat/completions"
    assert attrs["shapegate.lane"] == "fast"
    assert attrs["shapegate.cluster"] == "fast"
    assert attrs["shapegate.endpoint"] == engine_url
    assert attrs["shapegate.reason"] == "in_range"
    # The bound decided; the exact count (made while the engine worked) is the token figure.
    assert attrs["shapegate.count_method"] == "bound"
    assert attrs["shapegate.prompt_tokens"] == int(answer.headers["x-shapegate-prompt-tokens"])
    assert attrs["shapegate.prompt_tokens"] < attrs["shapegate.prompt_tokens_bound"]
    assert attrs["shapegate.queue_wait_s"] >= 0
    assert attrs["shapegate.retries"] == 0
    assert attrs["shapegate.outcome"] == "ok"
    assert attrs["http.response.status_code"] == 200
    assert attrs["shapegate.request_id"] == "t1"
    assert server.status.status_code == StatusCode.UNSET
    (tried,) = server.events
    assert tried.name == "engine.attempt"
    assert dict(tried.attributes or {})["shapegate.endpoint"] == engine_url
    assert_no_canary(spans)


async def test_without_a_client_traceparent_the_request_starts_a_new_trace(
    counter: TokenCounter,
) -> None:
    engine, _, memory, _ = await one_traced_request(counter, JSON, "t2")
    (server,) = memory.get_finished_spans()
    assert server.parent is None
    trace_id = hexid(server.context.trace_id, 32)
    # Sampled (bit 0); a new trace id is random (W3C level 2's bit 1).
    assert engine.seen["t2"].headers["traceparent"] in {
        f"00-{trace_id}-{hexid(server.context.span_id, 16)}-{flags}" for flags in ("01", "03")
    }
    assert "tracestate" not in engine.seen["t2"].headers


async def test_a_request_rejected_for_want_of_a_slot_has_its_span_and_no_attempt(
    counter: TokenCounter,
) -> None:
    engine = FakeEngine()
    async with serve_asgi(engine) as engine_url:
        config = fast_config([engine_url], slots={"lane": 1, "per_endpoint": 1}, on_full="reject")
        app, memory = traced(config, counter)
        async with gateway(app) as (url, client):
            holding = asyncio.create_task(
                client.post(
                    url + "/v1/chat/completions",
                    json=chat(fake={"mode": "slow_first_byte", "delay": 1.0}),
                    headers={**JSON, "x-request-id": "holder"},
                )
            )
            while "holder" not in engine.seen:
                await asyncio.sleep(0.01)
            refused = await client.post(
                url + "/v1/chat/completions",
                json=chat(),
                headers={**CLIENT_HEADERS, "x-request-id": "refused"},
            )
            assert refused.status_code == 429
            assert (await holding).status_code == 200
    spans = memory.get_finished_spans()
    servers = {
        dict(s.attributes or {})["shapegate.request_id"]: s for s in by_kind(spans, SpanKind.SERVER)
    }
    rejected = servers["refused"]
    attrs = dict(rejected.attributes or {})
    assert attrs["shapegate.outcome"] == "rejected"
    assert attrs["http.response.status_code"] == 429
    assert attrs["shapegate.lane"] == "fast"
    assert "shapegate.endpoint" not in attrs  # never admitted
    assert rejected.parent is not None and hexid(rejected.parent.span_id, 16) == CLIENT_SPAN
    # Only the admitted request tried an engine.
    assert rejected.events == ()
    assert [e.name for e in servers["holder"].events] == ["engine.attempt"]
    assert "refused" not in engine.seen
    holder_span = hexid(servers["holder"].context.span_id, 16)
    assert engine.seen["holder"].headers["traceparent"].split("-")[2] == holder_span
    assert_no_canary(spans)


async def test_a_failed_over_request_records_each_endpoint_tried(
    counter: TokenCounter,
) -> None:
    dead_port, live_port = ordered_ports()
    live = FakeEngine()
    async with (
        serve_asgi(live, port=live_port) as live_url,
        engine_that_dies(dead_port) as stop,
    ):
        dead_url = f"http://127.0.0.1:{dead_port}"
        app, memory = traced(fast_config([dead_url, live_url]), counter)
        async with gateway(app) as (url, client):
            await stop()
            answer = await client.post(
                url + "/v1/chat/completions",
                json=chat(),
                headers={**CLIENT_HEADERS, "x-request-id": "moved"},
            )
            assert answer.status_code == 200
    spans = memory.get_finished_spans()
    (server,) = spans
    assert server.parent is not None and hexid(server.parent.span_id, 16) == CLIENT_SPAN
    events = [(e.name, dict(e.attributes or {})) for e in server.events]
    assert events == [
        ("engine.attempt", {"shapegate.endpoint": dead_url, "shapegate.attempt": 1}),
        ("engine.failed_over", {"error.type": "refused", "shapegate.attempt": 1}),
        ("engine.attempt", {"shapegate.endpoint": live_url, "shapegate.attempt": 2}),
    ]
    attrs = dict(server.attributes or {})
    assert attrs["shapegate.retries"] == 1
    assert attrs["shapegate.endpoint"] == live_url
    assert attrs["shapegate.outcome"] == "ok"
    assert live.seen["moved"].headers["traceparent"] == (
        f"00-{CLIENT_TRACE}-{hexid(server.context.span_id, 16)}-01"
    )
    assert_no_canary(spans)


async def test_tracing_off_adds_no_header_and_passes_the_clients_unchanged(
    counter: TokenCounter,
) -> None:
    engine = FakeEngine()
    async with serve_asgi(engine) as engine_url:
        app = create_app(parse_settings(fast_config([engine_url]), environ={}), counter)
        assert app.gateway.recorder.tracing is None
        async with gateway(app) as (url, client):
            plain = await client.post(
                url + "/v1/chat/completions", json=chat(), headers={**JSON, "x-request-id": "a"}
            )
            given = await client.post(
                url + "/v1/chat/completions",
                json=chat(),
                headers={**CLIENT_HEADERS, "x-request-id": "b"},
            )
            assert plain.status_code == given.status_code == 200
        recent = list(app.gateway.recorder.recent)
        assert len(recent) == 2 and all(r.span is None for r in recent)  # no span made
        assert "traceparent" not in engine.seen["a"].headers
        assert engine.seen["b"].headers["traceparent"] == CLIENT_HEADERS["traceparent"]
        assert engine.seen["b"].headers["tracestate"] == CLIENT_HEADERS["tracestate"]


def test_tracing_settings_are_validated() -> None:
    config = lanes_config(["http://a"], ["http://b"])
    for bad, key in [
        ({"enabled": True, "protocol": "zipkin"}, "protocol"),
        ({"sample_ratio": 1.5}, "sample_ratio"),
        ({"endpoint": "collector:4317"}, "endpoint"),
        ({"export_timeout_s": 0}, "export_timeout_s"),
        ({"headers": {"bad header": "x"}}, "headers"),
        ({"exporter": "otlp"}, "exporter"),
    ]:
        with pytest.raises(ConfigError, match=key):
            parse_settings({**config, "tracing": bad}, environ={})
    good = parse_settings(
        {
            **config,
            "tracing": {
                "enabled": True,
                "protocol": "grpc",
                "endpoint": "http://collector:4317",
                "sample_ratio": 0.25,
                "headers": {"api-key": "s3cret"},
            },
        },
        environ={},
    )
    assert good.tracing.sample_ratio == 0.25
    assert "s3cret" not in str(good.model_dump(mode="json"))  # never in a reload's diff log


@asynccontextmanager
async def blackhole() -> AsyncIterator[tuple[str, list[socket.socket]]]:
    """A collector that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.setblocking(False)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
                accepted.append(conn)
            except BlockingIOError:
                stop.wait(0.01)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1/traces", accepted
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        listener.close()


async def test_an_unreachable_collector_never_fails_or_slows_a_request(
    counter: TokenCounter,
) -> None:
    """While an export hangs on a collector that never answers, requests finish (their spans
    only queue); the failed export is counted in swallowed errors and logged once; a second
    failure within the interval is counted, not logged. A refused collector: the same."""
    engine = FakeEngine()
    async with blackhole() as (collector, accepted), serve_asgi(engine) as engine_url:
        config = fast_config([engine_url])
        config["tracing"] = {"enabled": True, "endpoint": collector, "export_timeout_s": 3}
        app = create_app(parse_settings(config, environ={}), counter)
        tracing = app.gateway.recorder.tracing
        assert tracing is not None
        async with gateway(app) as (url, client):
            with capture_logs() as logs:
                first = await client.post(url + "/v1/chat/completions", json=chat(), headers=JSON)
                assert first.status_code == 200
                flushing = threading.Thread(target=tracing.flush, args=(10,), daemon=True)
                flushing.start()
                while not accepted:
                    await asyncio.sleep(0.01)
                answers = [
                    await client.post(url + "/v1/chat/completions", json=chat(), headers=JSON)
                    for _ in range(10)
                ]
                assert [a.status_code for a in answers] == [200] * 10
                assert flushing.is_alive()  # no request waited for the export
                await asyncio.to_thread(flushing.join)
                await asyncio.to_thread(tracing.flush, 10)  # the second batch fails too
            metrics = parse((await client.get(url + "/metrics")).text)
    swallowed = [e for e in logs if e["event"] == "error.swallowed"]
    assert [e["where"] for e in swallowed] == ["tracing.export"]
    assert metrics.value("shapegate_swallowed_errors_total", where="tracing.export") == 2


def test_a_refused_collector_is_counted_and_logged_once_per_interval() -> None:
    metrics = Metrics()
    clock = [0.0]
    settings = TracingSettings(
        enabled=True, endpoint=f"http://127.0.0.1:{free_port()}/v1/traces", export_timeout_s=0.5
    )
    guarded = GuardedExporter(
        otlp_exporter(settings), metrics, get_logger("test"), every_s=60, clock=lambda: clock[0]
    )
    tracing = Tracing.build(settings, guarded)
    with capture_logs() as logs:
        for step in (0.0, 1.0, 61.0):
            clock[0] = step
            tracing.request((), "POST", "/v1/chat/completions").end({}, 200, None)
            tracing.flush(5)
    tracing.close()
    assert guarded.failures == 3
    logged = [e for e in logs if e["event"] == "error.swallowed"]
    assert [e["unlogged_failures"] for e in logged] == [0, 1]
    counted = parse(generate_latest(metrics.registry).decode())
    assert counted.value("shapegate_swallowed_errors_total", where="tracing.export") == 3
