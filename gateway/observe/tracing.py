"""OpenTelemetry traces of requests: one span per request, its engine attempts as events.

Contract:
- ``Tracing.from_settings(settings.tracing, metrics, log)`` is None when tracing is off (the
  default): nothing of OpenTelemetry is imported, no span exists, no header is added; the
  client's own ``traceparent`` / ``tracestate`` pass to the engine unchanged, as any allowlisted
  header. On, it needs ``pip install 'shapegate[otel]'`` (``MissingExtra`` naming the extra
  otherwise) and exports by OTLP (``http/protobuf`` or ``grpc``) from the SDK's batch thread.
- ``tracing.request(headers, method, path)`` starts the request's SERVER span: a child of the
  client's W3C ``traceparent`` (its ``tracestate`` kept) when it sent a valid one, else the root
  of a new trace; sampled parent-based with ``sample_ratio`` for new traces.
- ``span.attempt(url)`` records a try at an engine (an ``engine.attempt`` event; a failed-over
  request has one per endpoint tried, and an ``engine.failed_over`` event with ``error.type``
  = the reason for each move, ``span.attempt_failed(reason)``) and returns the
  ``traceparent`` (and ``tracestate``) the engine gets: the client's trace id, the request's
  span as parent, so the engine's own spans nest under it. One span, not a CLIENT span per
  try: a span costs the SDK as much as the rest of a request's recording (README, "Tracing").
- ``span.end(attributes, status, error_type)`` ends the span; the attributes are the routing
  decision (gateway/observe/record.py's ``Record.span_attributes``), never prompt or completion
  text.
- Export never fails or slows a request: spans queue in memory (bounded; dropped when full)
  and a background thread sends them, each export bounded by ``export_timeout_s``. Every failed
  export is counted in ``shapegate_swallowed_errors_total{where="tracing.export"}``; one
  ``error.swallowed`` line is logged at most every ``LOG_EVERY_S`` with how many went unlogged.
- ``close()`` (blocking: flushes within the export timeout) at shutdown; ``in_use`` counts the
  request spans not yet ended, so a reload can retire the old exporter after its last span.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from gateway.extras import optional
from gateway.lifetime import InUse
from gateway.observe.log import Logger, swallowed
from gateway.observe.metrics import Metrics
from gateway.settings import TracingSettings

EXTRA = "otel"
# A failing collector is logged at most this often (every failure is counted).
LOG_EVERY_S = 60.0
# Spans waiting for the export thread (the SDK's default): past it, spans are dropped.
QUEUE_SIZE = 2048
# Attribute values: what OpenTelemetry takes (None-valued ones are left out).
Value = str | bool | int | float


class ExportFailed(Exception):
    """The OTLP exporter reported a failed export (it logs no exception of its own)."""


class GuardedExporter:
    """The OTLP exporter as the batch thread calls it: a failure, raised or returned, is counted
    every time and logged at most once per ``every_s``."""

    def __init__(
        self,
        inner: Any,
        metrics: Metrics | None,
        log: Logger,
        every_s: float = LOG_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._inner = inner
        self._metrics = metrics
        self._log = log
        self._every_s = every_s
        self._clock = clock
        self._logged_at: float | None = None
        self._unlogged = 0
        self._lock = threading.Lock()
        self.failures = 0
        export = optional("opentelemetry.sdk.trace.export", EXTRA)
        self._success = export.SpanExportResult.SUCCESS
        self._failure = export.SpanExportResult.FAILURE

    def export(self, spans: Sequence[Any]) -> Any:
        try:
            result = self._inner.export(spans)
        except Exception as exc:  # noqa: BLE001 - the batch thread: counted and logged below
            self._failed(exc, len(spans))
            return self._failure
        if result != self._success:
            self._failed(ExportFailed(f"OTLP export of {len(spans)} spans failed"), len(spans))
        return result

    def _failed(self, exc: Exception, spans: int) -> None:
        with self._lock:
            self.failures += 1
            now = self._clock()
            due = self._logged_at is None or now - self._logged_at >= self._every_s
            unlogged = self._unlogged
            if due:
                self._logged_at, self._unlogged = now, 0
            else:
                self._unlogged += 1
        if due:
            swallowed(
                self._log,
                self._metrics,
                "tracing.export",
                exc,
                "spans_dropped",
                spans=spans,
                unlogged_failures=unlogged,
            )
        elif self._metrics is not None:
            self._metrics.swallowed_errors.labels(where="tracing.export").inc()

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return bool(self._inner.force_flush(timeout_millis))


def missing_extra(
    settings: TracingSettings, find: Callable[[str], object | None] = importlib.util.find_spec
) -> str | None:
    """What check-config says when tracing is on but the packages it needs are not installed."""
    exporter = "grpc" if settings.protocol == "grpc" else "http"
    for module in ("opentelemetry.sdk.trace", f"opentelemetry.exporter.otlp.proto.{exporter}"):
        try:
            found = find(module)
        except ModuleNotFoundError:
            found = None
        if found is None:
            return (
                f"tracing is enabled but {module} is not installed: it comes with shapegate's "
                f"[{EXTRA}] extra (pip install 'shapegate[{EXTRA}]')"
            )
    return None


def otlp_exporter(settings: TracingSettings) -> Any:
    """The OTLP span exporter the settings name (``MissingExtra`` if not installed)."""
    headers = {name: value.get_secret_value() for name, value in settings.headers.items()}
    # The exporters log every failed export themselves; GuardedExporter reports them instead,
    # rate-limited, in the gateway's own log.
    logging.getLogger("opentelemetry.exporter.otlp").setLevel(logging.CRITICAL)
    if settings.protocol == "grpc":
        grpc = optional("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", EXTRA)
        return grpc.OTLPSpanExporter(
            endpoint=settings.endpoint,
            headers=headers,
            timeout=settings.export_timeout_s,
            insecure=settings.endpoint.startswith("http://"),
        )
    http = optional("opentelemetry.exporter.otlp.proto.http.trace_exporter", EXTRA)
    return http.OTLPSpanExporter(
        endpoint=settings.endpoint, headers=headers, timeout=settings.export_timeout_s
    )


class Tracing:
    """A tracer provider of our own (never the process-global one) and what a request needs."""

    def __init__(self, provider: Any) -> None:
        self._provider = provider
        self._tracer = provider.get_tracer("shapegate")
        trace = optional("opentelemetry.trace", EXTRA)
        tracecontext = optional("opentelemetry.trace.propagation.tracecontext", EXTRA)
        self._propagator = tracecontext.TraceContextTextMapPropagator()
        self._in_context = trace.set_span_in_context
        self._server_kind = trace.SpanKind.SERVER
        self._status = trace.Status
        self._error = trace.StatusCode.ERROR
        self.in_use = InUse()

    @classmethod
    def from_settings(
        cls, settings: TracingSettings, metrics: Metrics | None, log: Logger
    ) -> Tracing | None:
        if not settings.enabled:
            return None
        exporter = GuardedExporter(otlp_exporter(settings), metrics, log)
        return cls.build(settings, exporter)

    @classmethod
    def build(
        cls,
        settings: TracingSettings,
        exporter: Any,
        *,
        batch: bool = True,
        queue_size: int = QUEUE_SIZE,
    ) -> Tracing:
        """Spans to ``exporter``: batched in a background thread (at most ``queue_size`` spans
        wait; more are dropped), or (``batch=False``, for tests with an in-memory exporter)
        exported as each span ends."""
        sdk = optional("opentelemetry.sdk.trace", EXTRA)
        export = optional("opentelemetry.sdk.trace.export", EXTRA)
        sampling = optional("opentelemetry.sdk.trace.sampling", EXTRA)
        resources = optional("opentelemetry.sdk.resources", EXTRA)
        provider = sdk.TracerProvider(
            resource=resources.Resource.create({"service.name": settings.service_name}),
            sampler=sampling.ParentBased(sampling.TraceIdRatioBased(settings.sample_ratio)),
            shutdown_on_exit=False,
        )
        processor = (
            export.BatchSpanProcessor(
                exporter,
                max_queue_size=queue_size,
                export_timeout_millis=int(settings.export_timeout_s * 1000),
            )
            if batch
            else export.SimpleSpanProcessor(exporter)
        )
        provider.add_span_processor(processor)
        return cls(provider)

    def request(
        self, headers: Iterable[tuple[bytes, bytes]], method: str, path: str
    ) -> RequestSpan:
        carrier = {}
        for name, value in headers:
            if name in (b"traceparent", b"tracestate"):
                carrier[name.decode()] = value.decode("latin-1")
        parent = self._propagator.extract(carrier) if carrier else None
        span = self._tracer.start_span(
            f"{method} {path}",
            context=parent,
            kind=self._server_kind,
            attributes={"http.request.method": method, "http.route": path},
        )
        self.in_use.enter()
        return RequestSpan(self, span)

    def flush(self, timeout_s: float) -> bool:
        """Export what is queued now (blocking, at most ``timeout_s``)."""
        return bool(self._provider.force_flush(int(timeout_s * 1000)))

    def close(self) -> None:
        """Flush and stop the export thread (blocking, within the export timeout)."""
        self._provider.shutdown()


class RequestSpan:
    """One request's span, and the trace headers its engine attempts carry."""

    __slots__ = ("_headers", "_server", "_tracing", "attempts")

    def __init__(self, tracing: Tracing, server: Any) -> None:
        self._tracing = tracing
        self._server = server
        self._headers: dict[str, str] | None = None
        self.attempts = 0

    def attempt(self, url: str) -> dict[str, str]:
        """A try at ``url`` (an ``engine.attempt`` event on the span); the trace headers the
        engine gets: the request's span as its parent, the same for every try."""
        self.attempts += 1
        self._server.add_event(
            "engine.attempt", {"shapegate.endpoint": url, "shapegate.attempt": self.attempts}
        )
        if self._headers is None:
            carrier: dict[str, str] = {}
            tracing = self._tracing
            tracing._propagator.inject(carrier, context=tracing._in_context(self._server))
            self._headers = carrier
        return self._headers

    def attempt_failed(self, reason: str) -> None:
        """The try reached no engine and the request moves on (``engine.failed_over``)."""
        self._server.add_event(
            "engine.failed_over", {"error.type": reason, "shapegate.attempt": self.attempts}
        )

    def attempt_paused(self) -> None:
        """The try was stopped before its first byte for a cached question on its endpoint; the
        request waits and tries the same endpoint again (``engine.paused``)."""
        self._server.add_event("engine.paused", {"shapegate.attempt": self.attempts})

    def end(self, attributes: Mapping[str, Value | None], status: int, error: str | None) -> None:
        """Set the decision's attributes and the status, and end the span."""
        tracing, server = self._tracing, self._server
        server.set_attributes({k: v for k, v in attributes.items() if v is not None})
        if status:
            server.set_attribute("http.response.status_code", status)
        if error is not None:
            server.set_attribute("error.type", error)
            server.set_status(tracing._status(tracing._error, error))
        server.end()
        tracing.in_use.leave()

    @property
    def context(self) -> tuple[int, int]:
        """The span's (trace id, span id)."""
        ctx = self._server.get_span_context()
        return ctx.trace_id, ctx.span_id
