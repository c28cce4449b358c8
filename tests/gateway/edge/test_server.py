"""gateway/edge/server.py: the process edge of ``shapegate serve``."""

from __future__ import annotations

import gc
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from gateway.edge import server as server_module
from gateway.edge.server import serve, serve_worker, settle_heap
from gateway.observe.log import configure_logging, get_logger
from gateway.settings import Settings, parse_settings
from gateway.slots.host import WorkerGroup
from tests.conftest import lanes_config
from tests.support.servers import free_port


@pytest.fixture
def unfrozen() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()  # the test process goes on collecting what it froze
    gc.set_threshold(*threshold)


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


class _Server:
    """uvicorn's ``Server`` as ``serve`` uses it: ``run`` notes the collector's state it starts
    serving with, and returns at once."""

    seen: list[tuple[int, int, int]] = []
    logging: list[tuple[Any, Any]] = []

    def __init__(self, config: Any) -> None:
        pass

    def run(self, sockets: Any = None) -> None:
        self.seen.append(gc.get_threshold())
        for sock in sockets or ():
            sock.close()


@pytest.fixture
def fake_server(monkeypatch: pytest.MonkeyPatch, unfrozen: None) -> Iterator[list[Any]]:
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    monkeypatch.setattr(server_module, "uvicorn_config", lambda *a, **k: None)
    monkeypatch.setattr(server_module.uvicorn, "Server", _Server)
    monkeypatch.setattr(
        server_module, "configure_logging", lambda *a, **k: _Server.logging.append((a, k))
    )
    monkeypatch.setattr(server_module, "_stop_when_orphaned", lambda parent: None)
    _Server.seen = []
    _Server.logging = []
    gc.set_threshold(700, 10, 10)  # CPython's defaults
    yield _Server.seen
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    structlog.contextvars.clear_contextvars()


def _settings() -> Settings:
    settings = parse_settings(lanes_config(["http://e"], ["http://e"]), environ={})
    listen = settings.server.model_copy(update={"host": "127.0.0.1", "port": free_port()})
    return settings.model_copy(update={"server": listen})


def test_serve_collects_the_young_generation_every_10_000_allocations(
    fake_server: list[Any],
) -> None:
    """A request frees what it allocates by reference counting: at CPython's 700 the young
    generation was collected every few requests for nothing. The older thresholds stay."""
    assert serve(_settings()) == 0
    assert fake_server == [(10_000, 10, 10)]  # YOUNG_COLLECT_AT


def test_each_worker_settles_its_heap_too(fake_server: list[Any], tmp_path: Path) -> None:
    frozen_before = gc.get_freeze_count()
    assert serve_worker(_settings(), None, WorkerGroup(0, 2, tmp_path)) == 0
    assert fake_server == [(10_000, 10, 10)]
    assert gc.get_freeze_count() > frozen_before


def test_serve_and_each_worker_configure_logging_alike(
    fake_server: list[Any], tmp_path: Path
) -> None:
    """Both serving paths configure their process once, loggers cached (the recorder then holds
    the assembled logger) and lines batched: a worker did not cache."""
    assert serve(_settings()) == 0
    assert serve_worker(_settings(), None, WorkerGroup(0, 2, tmp_path)) == 0
    serving, worker = _Server.logging
    assert serving == worker
    assert serving[1] == {"cache": True, "batch": True}
