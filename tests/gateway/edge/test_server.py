"""gateway/edge/server.py: the process edge of ``shapegate serve``."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import structlog
from structlog.testing import capture_logs

from gateway.edge.server import settle_heap
from gateway.observe.log import configure_logging, get_logger


@pytest.fixture
def unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()  # the test process goes on collecting what it froze


def test_settle_heap_takes_start_up_objects_out_of_every_later_full_collection(
    unfrozen: None,
) -> None:
    alive_at_start = [[i] for i in range(50_000)]  # container objects the collector tracks
    gc.collect()
    tracked_before = len(gc.get_objects())

    frozen = settle_heap()

    assert frozen >= len(alive_at_start)
    # What a full collection walks shrank by at least the objects start-up left alive: they are
    # in the permanent generation now, still alive and freed by reference counting.
    assert len(gc.get_objects()) <= tracked_before - len(alive_at_start)
    assert alive_at_start[49_999] == [49_999]
    made_later = [[i] for i in range(1000)]
    assert all(gc.is_tracked(x) for x in made_later[:10])
    assert gc.get_freeze_count() == frozen


def test_cached_loggers_still_reach_capture_and_default_is_uncached() -> None:
    configure_logging("info", json_output=True, cache=True)
    try:
        assert structlog.get_config()["cache_logger_on_first_use"] is True
        log = get_logger("test")
        with capture_logs() as first:
            log.info("route.finished", n=1)
        with capture_logs() as second:  # the cached logger sees the processors swapped again
            log.info("route.finished", n=2)
        assert [e["n"] for e in first] == [1] and [e["n"] for e in second] == [2]
    finally:
        configure_logging("info", json_output=True)
    assert structlog.get_config()["cache_logger_on_first_use"] is False
