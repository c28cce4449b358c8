"""The recorder (gateway/observe/recorder.py): what each way of ending reports, and to whom."""

from __future__ import annotations

from pathlib import Path

import orjson
import structlog
from structlog.testing import capture_logs

from gateway.core.count import TokenCount
from gateway.core.decision import Decision, Grant
from gateway.core.watchdog import DeadlineHit
from gateway.errors import BadRequest, NoHealthyCluster, UpstreamError
from gateway.observe.log import configure_logging, get_logger
from gateway.observe.metrics import Metrics
from gateway.observe.record import Record, Routed
from gateway.observe.recorder import Recorder
from gateway.protocols.openai import parse_request

COUNT = TokenCount(tokens=1234, method="exact", tokenizer="qwen", prompt_bytes=5000, seconds=0.002)


def sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def recorder(tmp_path: Path | None = None) -> Recorder:
    trace = str(tmp_path / "trace.jsonl") if tmp_path else None
    return Recorder(Metrics(), get_logger("test"), ring_size=4, trace_file=trace)


def routed(lane: str = "fast") -> Routed:
    if lane == "none":
        body = orjson.dumps({"model": "qwen3.6", "prompt": "hi", "max_tokens": 3})
        request = parse_request("completions", body)
        return Routed.of(request, COUNT, Decision(lane=None, clusters=(), reason="no_lane"), {})
    return Routed("qwen3.6", True, 6000, 64, COUNT, lane, "in_range", {"fast": True}, "chat")


def grant(lane: str = "fast") -> Grant:
    return Grant("slot-1", lane, "fast-a", "http://e:1", ("k",), 0.25)


def test_an_admitted_request_logs_one_decision_and_one_finish_with_typed_fields(
    tmp_path: Path,
) -> None:
    rec = recorder(tmp_path)
    record = Record(request_id="r1", route="chat")
    with capture_logs() as logs:
        rec.decided(record, routed())
        assert rec.snapshot()[0]["outcome"] == "in_flight"  # in the ring while it runs
        rec.admitted(record, grant())
        rec.chunk(record, record.started + 0.5)
        rec.chunk(record, record.started + 0.75)
        record.outcome, record.output_tokens = "ok", 7
        rec.finished(record, 200)
    decision, finished = logs
    assert decision["event"] == "route.decision" and decision["prompt_tokens"] == 1234
    assert decision["count_method"] == "exact" and decision["count_ms"] == 2.0
    assert decision["cluster"] == "fast-a" and decision["endpoint"] == "http://e:1"
    assert decision["queue_wait_s"] == 0.25 and decision["cluster_health"] == {"fast": True}
    assert finished["event"] == "route.finished" and finished["outcome"] == "ok"
    assert finished["ttft_s"] == 0.5 and finished["chunks"] == 2 and finished["status"] == 200
    m = rec.metrics
    ok = {"lane": "fast", "cluster": "fast-a", "outcome": "ok", "status_class": "2xx"}
    assert sample(m, "shapegate_requests_total", **ok) == 1
    at = {"lane": "fast", "cluster": "fast-a", "endpoint": "http://e:1"}
    assert sample(m, "shapegate_e2e_seconds_count", **at) == 1
    assert sample(m, "shapegate_ttft_seconds_sum", **at) == 0.5
    assert sample(m, "shapegate_itl_seconds_count", lane="fast", cluster="fast-a") == 1
    assert sample(m, "shapegate_prompt_tokens_sum", lane="fast") == 1234
    assert rec.window.lane_json("fast", record.started + 1)["outcomes"] == {"ok": 1}
    assert rec.trace is not None
    rec.trace.flush()
    line = orjson.loads((tmp_path / "trace.jsonl").read_bytes())
    assert line["prompt_tokens"] == 1234 and line["output_tokens"] == 7 and line["stream"]
    row = rec.snapshot()[0]
    assert row["outcome"] == "ok" and row["endpoint_kind"] == "chat" and row["duration_s"] >= 0


def test_refusals_before_admission_are_rejected_and_logged_once() -> None:
    rec = recorder()
    unparsed, no_lane = Record("r1", "chat"), Record("r2", "completions")
    rec.decided(no_lane, routed("none"))
    with capture_logs() as logs:
        for record, exc in (
            (unparsed, BadRequest("bad json")),
            (no_lane, NoHealthyCluster("no healthy cluster")),
        ):
            rec.refused(record, exc)
            rec.finished(record, exc.status)
    events = [e["event"] for e in logs]
    assert events == ["route.rejected", "route.finished"] * 2
    assert logs[0]["error"] == "bad json" and "prompt_tokens" not in logs[0]
    assert logs[2]["lane"] == "none" and logs[2]["reason"] == "no_lane"
    assert unparsed.outcome == no_lane.outcome == "rejected"
    assert [r["request_id"] for r in rec.snapshot()] == ["r1", "r2"]  # each in the ring once
    m = rec.metrics
    rejected = {"lane": "none", "cluster": "none", "outcome": "rejected"}
    assert sample(m, "shapegate_requests_total", status_class="4xx", **rejected) == 1  # 400
    assert sample(m, "shapegate_requests_total", status_class="5xx", **rejected) == 1  # 503
    assert sample(m, "shapegate_e2e_seconds_count", lane="none", cluster="none") is None


def test_after_admission_a_5xx_is_an_upstream_error_and_a_deadline_a_timeout() -> None:
    rec = recorder()
    failed, slow, cancelled = Record("r1", "chat"), Record("r2", "chat"), Record("r3", "chat")
    for record in (failed, slow, cancelled):
        rec.decided(record, routed())
        rec.admitted(record, grant())
    with capture_logs() as logs:
        rec.refused(failed, UpstreamError("engine reset"))
        rec.refused(slow, DeadlineHit("first_byte", 2.0))
        for record in (failed, slow, cancelled):
            rec.finished(record, None)
    assert "route.rejected" not in [e["event"] for e in logs]
    assert (failed.outcome, slow.outcome, cancelled.outcome) == (
        "upstream_error",
        "timeout",
        "cancelled",
    )
    assert slow.deadline == "first_byte" and slow.status == 504 and slow.admitted
    m = rec.metrics
    labels = {"lane": "fast", "cluster": "fast-a"}
    assert sample(m, "shapegate_watchdog_events_total", kind="first_byte", **labels) == 1
    assert sample(m, "shapegate_e2e_seconds_count", endpoint="http://e:1", **labels) == 3
    # The deadline also reaches the dashboard's event list, with what an operator needs.
    [event] = m.events.recent()
    assert event["kind"] == "watchdog" and event["where"] == "pipeline.deadline"
    assert event["message"] == "upstream first byte deadline of 2s exceeded"
    assert event["fields"] == {
        "deadline": "first_byte",
        "lane": "fast",
        "cluster": "fast-a",
        "endpoint": "http://e:1",
        "request_id": "r2",
    }


def test_a_deadline_that_migrated_a_stream_is_still_a_watchdog_event() -> None:
    """An idle deadline cut the stream and it migrated: the client saw nothing, the operator
    still sees the stalled engine (metric and the dashboard's list, decision ``migrated``)."""
    rec = recorder()
    record = Record("r9", "chat")
    rec.decided(record, routed())
    rec.admitted(record, grant())
    moved_to = Grant("slot-1", "fast", "fast-a", "http://e:2", ("k",), 0.25)
    rec.migrated(record, moved_to, "connection_lost", UpstreamError("reset"))
    assert rec.metrics.events.recent() == []
    rec.migrated(record, grant(), "idle", DeadlineHit("idle", 1.0))
    m = rec.metrics
    assert sample(m, "shapegate_watchdog_events_total", kind="idle", lane="fast", cluster="fast-a")
    [event] = m.events.recent()
    assert (event["kind"], event["decision"]) == ("watchdog", "migrated")
    assert event["fields"]["endpoint"] == "http://e:2" and record.migrations == 2


def test_a_serving_process_recorder_logs_through_a_logger_assembled_once() -> None:
    """Where loggers are cached (``shapegate serve``), the recorder holds the assembled logger,
    not the lazy proxy (two calls an event less); its events still reach a capture. Where they
    are not (tests reconfigure), it keeps the proxy."""
    proxy = type(structlog.get_logger())
    configure_logging("info", json_output=True, cache=True)
    try:
        served = recorder()
        assert not isinstance(served.log, proxy)
        record = Record(request_id="r1", route="chat")
        served.decided(record, routed())
        with capture_logs() as events:
            served.admitted(record, grant())
        assert [e["event"] for e in events] == ["route.decision"]
        assert events[0]["component"] == "test"
    finally:
        configure_logging("info", json_output=True)
    assert isinstance(recorder().log, proxy)
