"""gateway/observe/log.py's ``UtcStamper``: the timestamp every log line carries."""

from __future__ import annotations

import datetime as dt
import time

import pytest

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


class _Recording:
    """A file that keeps each flushed write apart."""

    def __init__(self) -> None:
        self.pending = ""
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.pending += text
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.writes.append(self.pending)
            self.pending = ""


async def test_lines_logged_in_one_loop_turn_go_out_in_one_write_at_its_end() -> None:
    import asyncio

    from gateway.observe.log import BatchedLoggerFactory

    file = _Recording()
    logger = BatchedLoggerFactory(file)()  # type: ignore[arg-type]
    logger.info("one")
    logger.warning("two")
    assert file.writes == []  # held for the end of this turn
    await asyncio.sleep(0)
    assert file.writes == ["one\ntwo\n"]
    logger.info("three")
    await asyncio.sleep(0)
    assert file.writes == ["one\ntwo\n", "three\n"]


def test_a_line_logged_off_the_loop_goes_out_at_once_with_what_was_held() -> None:
    from gateway.observe.log import BatchedLoggerFactory

    file = _Recording()
    factory = BatchedLoggerFactory(file)  # type: ignore[arg-type]
    factory.lines._lines.append("held\n")  # as a loop turn would have left it
    factory().info("now")
    assert file.writes == ["held\nnow\n"]


async def test_a_batch_is_written_in_writes_of_at_most_batch_bytes_on_line_boundaries() -> None:
    import asyncio

    from gateway.observe.log import BATCH_BYTES, BatchedLoggerFactory

    file = _Recording()
    logger = BatchedLoggerFactory(file)()  # type: ignore[arg-type]
    lines = [f"{i:04d}" + "x" * 995 for i in range(10)]  # 1,000 bytes with its newline
    long = "y" * (BATCH_BYTES + 10)
    for line in lines[:3]:
        logger.info(line)
    logger.info(long)  # past BATCH_BYTES: what is buffered goes out now
    for line in lines[3:]:
        logger.info(line)
    await asyncio.sleep(0)
    assert "".join(file.writes) == "".join(f"{x}\n" for x in [*lines[:3], long, *lines[3:]])
    assert all(w.endswith("\n") for w in file.writes)
    assert all(len(w) <= BATCH_BYTES for w in file.writes if long not in w)
    assert [w for w in file.writes if long in w] == [long + "\n"]


def test_info_writes_the_line_structlog_would(capsys: pytest.CaptureFixture[str]) -> None:
    """The JSON configuration's ``info`` renders through its ``JsonLine`` itself: the same line,
    key for key and in order, as structlog's own method (the bound context first, the fields,
    the event, the context variables, the level, the stamp); ``%`` arguments still go through
    structlog's."""
    import orjson
    import structlog

    from gateway.observe.log import configure_logging, get_logger

    before = structlog.get_config()
    configure_logging("info", json_output=True)
    try:
        structlog.contextvars.bind_contextvars(worker=3)
        bound = get_logger("recorder").bind(lane="fast")
        fields = {"request_id": "r1", "n": 2, "none": None, "text": "é"}
        bound.info("route.decision", **fields)
        base = type(bound).__mro__[1]  # structlog's filtering bound logger
        assert vars(type(bound))["info"] is not vars(base)["info"]
        base.info(bound, "route.decision", **fields)
        bound.info("route.%s", "finished", n=3)
        assert get_logger("x").debug("hidden") is None
    finally:
        structlog.contextvars.unbind_contextvars("worker")
        structlog.configure(**before)  # the session's (its file is not this test's capture)
    ours, theirs, interpolated = (orjson.loads(line) for line in capsys.readouterr().out.split())
    assert ours.pop("timestamp") and theirs.pop("timestamp")
    assert list(ours.items()) == list(theirs.items())
    order = ["component", "lane", "request_id", "n", "none", "text", "event", "worker", "level"]
    assert list(ours) == order
    assert interpolated["event"] == "route.finished" and interpolated["n"] == 3
