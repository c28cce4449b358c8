"""``shapegate bench tracing``: the CPU a request's trace costs, against the same request untraced.

What is timed: the recorder's whole per-request path (gateway/observe/recorder.py), as the pipeline
calls it for a routed request (received, decided, admitted, the attempt's trace headers, three
chunks, finished: two log lines to /dev/null, the metrics, the ring, the rolling window),
``--requests`` times, with process CPU time (``time.process_time``: every thread, so the batch
exporter's thread counts too; the final flush is inside the timing). Modes, interleaved over
``--rounds`` rounds so a busy neighbour hits each alike, the median round kept:

- ``off``: tracing off (the default): the baseline; tracing adds no work here but a ``None``
  check per hook.
- ``unsampled``: tracing on, the client's traceparent unsampled: a non-recording span, the
  engine's traceparent still built.
- ``sampled``: tracing on, every request recorded, the SDK's batch processor, an exporter that
  drops the batch (the SDK and our hooks, no encoding).
- ``otlp_encoded``: as ``sampled``, the exporter encoding each batch to OTLP protobuf bytes as
  the OTLP exporters do before they send (all the CPU of an export but the socket write).

Figures: CPU microseconds per request for each mode, and each mode's added cost as a ratio of
the ``off`` baseline measured in the same run. ``--smoke`` runs a few hundred requests.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import structlog

from gateway.core.count import TokenCount
from gateway.core.decision import Grant
from gateway.extras import optional
from gateway.observe.metrics import Metrics
from gateway.observe.record import Record, Routed
from gateway.observe.recorder import Recorder
from gateway.observe.tracing import EXTRA, Tracing
from gateway.settings import TracingSettings
from gateway.tools.bench.harness import machine, machine_line, write_json

MODES = ("off", "unsampled", "sampled", "otlp_encoded")


def scope_for(mode: str) -> dict[str, Any]:
    """A request whose client sent a traceparent: sampled, except in the ``unsampled`` mode
    (sampling is parent-based: the client's flag decides)."""
    flags = b"00" if mode == "unsampled" else b"01"
    return {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [
            (b"host", b"127.0.0.1:8000"),
            (b"content-type", b"application/json"),
            (b"traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-" + flags),
        ],
    }


def register(suites: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = suites.add_parser("tracing", help="CPU per request of a trace, against none")
    parser.add_argument("--out", default="bench-results", help="folder for tracing.json")
    parser.add_argument("--smoke", action="store_true", help="a few hundred requests")
    parser.add_argument("--requests", type=int, default=20_000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every mode")
    parser.set_defaults(func=run)


class DroppingExporter:
    """Takes every batch and drops it: the SDK's cost without an export."""

    def __init__(self, encode: bool) -> None:
        self._encode = optional("opentelemetry.exporter.otlp.proto.common.trace_encoder", EXTRA)
        self._result = optional("opentelemetry.sdk.trace.export", EXTRA).SpanExportResult
        self.encoding = encode
        self.bytes = 0
        self.spans = 0

    def export(self, spans: Any) -> Any:
        self.spans += len(spans)
        if self.encoding:  # what the OTLP exporters do before the socket write
            self.bytes += len(self._encode.encode_spans(spans).SerializeToString())
        return self._result.SUCCESS

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


def recorder_for(
    mode: str, devnull: Any, requests: int = 0
) -> tuple[Recorder, DroppingExporter | None]:
    log = structlog.wrap_logger(
        structlog.WriteLogger(devnull),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ],
    )
    tracing, exporter = None, None
    if mode != "off":
        settings = TracingSettings(enabled=True, sample_ratio=0.0 if mode == "unsampled" else 1.0)
        exporter = DroppingExporter(encode=mode == "otlp_encoded")
        # Room for every span of the round: a dropped span would be CPU not spent encoding.
        tracing = Tracing.build(settings, exporter, queue_size=max(2048, 2 * requests + 4))
    recorder = Recorder(Metrics([5.0, 60.0, 900.0]), log, ring_size=200, tracing=tracing)
    return recorder, exporter


def one_request(recorder: Recorder, index: int, scope: dict[str, Any]) -> None:
    record = Record(request_id=f"r{index}", route="chat")
    recorder.received(record, scope)
    count = TokenCount(86, "bound", "qwen3.6/gigatoken", 86, 0.00007)
    routed = Routed("qwen3.6", True, 112, 16, count, "fast", "in_range", {"fast": True}, "chat")
    recorder.decided(record, routed)
    grant = Grant(f"t{index}", "fast", "fast", "http://127.0.0.1:9001", ("k",), 0.0001)
    recorder.admitted(record, grant)
    recorder.attempt(record, grant.url)
    now = time.monotonic()
    for step in range(3):
        recorder.chunk(record, now + step * 0.001)
    record.status, record.outcome = 200, "ok"
    record.prompt_tokens, record.output_tokens = 22, 3
    recorder.finished(record, 200)


def one_round(mode: str, requests: int, devnull: Any) -> tuple[float, int]:
    """CPU seconds per request of ``requests`` requests through a fresh recorder, and the
    spans exported."""
    recorder, exporter = recorder_for(mode, devnull, requests)
    scope = scope_for(mode)
    one_request(recorder, -1, scope)  # warm: label children, first imports
    started = time.process_time()
    for index in range(requests):
        one_request(recorder, index, scope)
    if recorder.tracing is not None:
        recorder.tracing.flush(30)
    spent = time.process_time() - started
    if recorder.tracing is not None:
        recorder.tracing.close()
    return spent / requests, exporter.spans if exporter is not None else 0


def measure(requests: int, rounds: int) -> dict[str, Any]:
    info = machine()
    per_mode: dict[str, list[float]] = {mode: [] for mode in MODES}
    spans: dict[str, int] = {}
    with open(os.devnull, "w", encoding="utf-8") as devnull:
        for _ in range(rounds):
            for mode in MODES:
                seconds, spans[mode] = one_round(mode, requests, devnull)
                per_mode[mode].append(seconds)
    us = {mode: statistics.median(values) * 1e6 for mode, values in per_mode.items()}
    base = us["off"]
    return {
        "machine": {**info, "load_average_after": [round(x, 2) for x in os.getloadavg()]},
        "requests_per_round": requests,
        "rounds": rounds,
        "cpu_us_per_request": {mode: round(v, 2) for mode, v in us.items()},
        "added_us_per_request": {mode: round(v - base, 2) for mode, v in us.items()},
        "ratio_to_off": {mode: round(v / base, 3) for mode, v in us.items()},
        "rounds_us": {m: [round(v * 1e6, 2) for v in vs] for m, vs in per_mode.items()},
        # One span a sampled request; none dropped.
        "spans_exported_last_round": spans,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        machine_line(result["machine"]),
        f"recorder path, {result['requests_per_round']:,} requests x {result['rounds']} rounds"
        " (median round), CPU per request:",
        f"{'mode':<14}{'us/request':>12}{'added us':>10}{'x off':>8}",
    ]
    for mode in MODES:
        lines.append(
            f"{mode:<14}{result['cpu_us_per_request'][mode]:>12.1f}"
            f"{result['added_us_per_request'][mode]:>10.1f}{result['ratio_to_off'][mode]:>8.2f}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    requests, rounds = (300, 2) if args.smoke else (args.requests, args.rounds)
    result = {**measure(requests, rounds), "smoke": bool(args.smoke)}
    path = write_json(Path(args.out), "tracing", result)
    print(table(result))
    print(f"\nwritten: {path}")
    return 0
