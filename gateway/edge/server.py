"""Run a gateway under uvicorn (uvloop + httptools where installed).

uvicorn handles SIGTERM and SIGINT: it stops accepting connections, waits for open ones up to
``server.drain_timeout_s``, then runs the app's lifespan shutdown, which drains the pipeline and
closes every client. The exit code is 0 after a clean drain.

Before serving, ``settle_heap()`` collects once and freezes what start-up left alive
(``gc.freeze``): the policy, the tokenizers' tables, FastAPI, pydantic and the imported modules,
about 100,000 objects. Without it each full (generation 2) collection walked all of them again,
tens of milliseconds during which the event loop answered nothing: the periodic tail stall of
issue 21 (p99 9x p50 at a steady 100 requests/s). Objects made while serving are collected as
before; frozen ones are still freed by reference counting, only a cycle among them waits for
``gc.unfreeze``. It also raises the young generation's threshold to ``YOUNG_COLLECT_AT``
(CPython's default is 700 allocations): a request allocates a few hundred tracked objects and
frees almost all of them by reference counting, so at 700 the young generation was collected
every few requests for nothing; cyclic garbage (a traceback, an exception's frames) is still
collected, a little later. Both ``serve`` and each worker of ``serve --workers`` settle so.
``serve_worker`` runs one worker of ``shapegate serve --workers N`` (gateway/edge/workers.py): the
same server on its own SO_REUSEPORT socket on the port the supervisor reserved, plus a private
unix socket the other workers reach it on for the gateway-wide views (gateway/edge/peers.py). A
worker whose supervisor died stops itself the same way, with SIGTERM.
"""

from __future__ import annotations

import gc
import importlib.util
import math
import os
import signal
import socket
import threading
from pathlib import Path

import structlog
import uvicorn

from gateway.edge.app import create_app
from gateway.edge.http_protocol import guarded_protocol
from gateway.lifetime import hold_heap, trim_heap
from gateway.observe.log import configure_logging
from gateway.settings import Settings
from gateway.slots.host import WorkerGroup

PARENT_POLL_S = 0.5
BACKLOG = 2048  # uvicorn's default


def uvicorn_config(
    settings: Settings, config_path: Path | None = None, group: WorkerGroup | None = None
) -> uvicorn.Config:
    fast = importlib.util.find_spec("uvloop") and importlib.util.find_spec("httptools")
    return uvicorn.Config(
        create_app(settings, config_path=config_path, group=group),
        host=settings.server.host,
        port=settings.server.port,
        loop="uvloop" if fast else "asyncio",
        http=guarded_protocol(settings.server) if fast else "h11",
        log_level="warning",
        access_log=False,
        # uvicorn takes whole seconds: round up, never down to 0 or None, which would be "wait
        # for ever" for a drain deadline below a second.
        timeout_graceful_shutdown=math.ceil(settings.server.drain_timeout_s),
        h11_max_incomplete_event_size=64 * 1024,
        limit_concurrency=None,
    )


# Freed heap the gateway keeps mapped for the next monster burst (lifetime.hold_heap): a burst
# of 4 x 1M-token prompts uses about this much while it is counted.
KEEP_HEAP_MB = 128

# Allocations (of objects the cyclic collector tracks) between two young collections.
YOUNG_COLLECT_AT = 10_000


def settle_heap() -> int:
    """Collect, then freeze every object alive now out of the cyclic collector's walks, give
    what start-up freed back to the system, then hold the heap a monster burst grows (the boot
    rehearsal grows it before the first request); the young generation collected every
    ``YOUNG_COLLECT_AT`` allocations from then on (the older ones' thresholds kept); the number
    of frozen objects."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECT_AT, older, oldest)
    trim_heap()
    hold_heap(KEEP_HEAP_MB)
    return gc.get_freeze_count()


def serve(settings: Settings, config_path: Path | None = None) -> int:
    _configure_logging(settings)
    _run(uvicorn.Server(uvicorn_config(settings, config_path)))
    return 0


def _configure_logging(settings: Settings) -> None:
    """A serving process's logging, ``serve``'s and each worker's alike. One process,
    configured once: its loggers may keep what they assembled on first use (and the recorder
    holds the assembled logger: gateway/observe/recorder.py)."""
    configure_logging(settings.logging.level, settings.logging.json_output, cache=True, batch=True)


def _run(server: uvicorn.Server, sockets: list[socket.socket] | None = None) -> None:
    settle_heap()  # after the app, its policy and its tokenizers are built
    # uvicorn re-raises the signal that stopped it once it has drained; a drained shutdown is a
    # clean exit, so the re-raised SIGTERM/SIGINT lands on a handler that lets us return 0.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: None)
    server.run(sockets=sockets)


def serve_worker(settings: Settings, config_path: Path | None, group: WorkerGroup) -> int:
    """One worker of a group: serve on the shared port (SO_REUSEPORT) and a private socket."""
    _configure_logging(settings)
    structlog.contextvars.bind_contextvars(worker=group.index)
    family = socket.AF_INET6 if ":" in settings.server.host else socket.AF_INET
    listener = socket.create_server(
        (settings.server.host, settings.server.port),
        family=family,
        backlog=BACKLOG,
        reuse_port=True,
    )
    private = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = group.peer_socket(group.index)
    path.unlink(missing_ok=True)  # a previous worker of this index that was killed
    private.bind(str(path))
    os.chmod(path, 0o600)
    private.listen(128)
    server = uvicorn.Server(uvicorn_config(settings, config_path, group))
    threading.Thread(target=_stop_when_orphaned, args=(os.getppid(),), daemon=True).start()
    _run(server, [listener, private])
    return 0


def _stop_when_orphaned(parent: int) -> None:
    """SIGTERM ourselves (a drain) when the supervisor is gone: nobody would stop us."""
    while os.getppid() == parent:
        threading.Event().wait(PARENT_POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)
