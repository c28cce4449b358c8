"""gateway/observe/log.py's ``UtcStamper``: the timestamp every log line carries."""

from __future__ import annotations

import datetime as dt
import time

from gateway.observe.log import UtcStamper


def test_the_stamp_is_utc_iso_with_microseconds_and_follows_the_clock() -> None:
    stamper = UtcStamper()
    stamps = []
    for _ in range(3):
        before = dt.datetime.now(dt.UTC)
        stamp = stamper(None, "info", {})["timestamp"]
        after = dt.datetime.now(dt.UTC)
        assert stamp.endswith("Z") and len(stamp) == len("2026-12-01T13:53:54.310065Z")
        at = dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
        assert before - dt.timedelta(microseconds=1) <= at <= after
        stamps.append(at)
        time.sleep(0.6)  # crosses at least one second boundary: the cached prefix moves on
    assert stamps == sorted(stamps) and stamps[-1] - stamps[0] >= dt.timedelta(seconds=1)


def test_the_json_line_holds_the_event_level_stamp_context_and_any_value() -> None:
    import orjson
    import structlog

    from gateway.observe.log import JsonLine

    class Opaque:
        def __repr__(self) -> str:
            return "<opaque>"

    structlog.contextvars.bind_contextvars(worker=3)
    try:
        line = JsonLine()(None, "warn", {"event": "route.finished", "x": 1, "o": Opaque()})
    finally:
        structlog.contextvars.unbind_contextvars("worker")
    parsed = orjson.loads(line)
    assert parsed["event"] == "route.finished" and parsed["x"] == 1 and parsed["worker"] == 3
    assert parsed["level"] == "warning" and parsed["o"] == "<opaque>"
    assert parsed["timestamp"].endswith("Z")
