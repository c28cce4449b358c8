"""structlog setup and the one helper for errors the gateway chooses not to raise.

Events are key-value, named ``noun.verb`` (``route.decision``, ``slot.acquired``,
``route.finished``, ``engine.state_changed``, ``error.swallowed``). Log and metric fields share
names. Prompt and completion text are never logged.

Contract of ``swallowed``: call it in every ``except`` that does not re-raise. It logs
``error.swallowed`` with where it happened, the exception type and message, and the decision
the error changed (``decision="fail_open"``, ``decision="treated_as_disconnect"`` ...), and
increments ``shapegate_swallowed_errors_total{where}``.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any, TextIO

import orjson
import structlog

if TYPE_CHECKING:
    from gateway.observe.metrics import Metrics

Logger = structlog.typing.FilteringBoundLogger

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def _fallback(obj: Any) -> Any:
    """What JSONRenderer's default writes for a value orjson cannot: ``__structlog__()``, else
    its repr."""
    try:
        return obj.__structlog__()
    except AttributeError:
        return repr(obj)


class UtcStamper:
    """``timestamp``: UTC ISO 8601 with microseconds and a ``Z``, as structlog's
    ``TimeStamper(fmt="iso", utc=True)`` writes it, at a fifth of its cost (two events a request):
    the date and time of day are formatted once a second, the microseconds appended."""

    __slots__ = ("_prefix", "_second")

    def __init__(self) -> None:
        self._second = -1
        self._prefix = ""

    def __call__(
        self, logger: Any, method: str, event: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        now = time.time()
        second = int(now)
        if second != self._second:
            self._prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._second = second
        event["timestamp"] = f"{self._prefix}.{int((now - second) * 1_000_000):06d}Z"
        return event


class JsonLine:
    """The JSON processor chain in one call: the context's bound fields, ``level``,
    ``timestamp`` (``UtcStamper``) and the line rendered by orjson. structlog's chain of four
    processors cost two calls and a dict lookup more per step, on two events a request."""

    __slots__ = ("_stamp",)

    def __init__(self) -> None:
        self._stamp = UtcStamper()

    def __call__(self, logger: Any, method: str, event: MutableMapping[str, Any]) -> str:
        structlog.contextvars.merge_contextvars(logger, method, event)
        event["level"] = _LEVEL_NAMES.get(method, method)
        self._stamp(logger, method, event)
        return orjson.dumps(event, default=_fallback).decode()


# structlog's add_log_level: the method's name, "warn" and "exception" aside.
_LEVEL_NAMES = {"warn": "warning", "exception": "error"}


# A batch is at most this many bytes (a line longer than it goes alone): POSIX's PIPE_BUF, the
# size up to which a write to a pipe is atomic, so the batches of several workers sharing one
# stdout pipe never interleave inside a line (one line a write was atomic the same way).
BATCH_BYTES = 4096


class BatchedLines:
    """The lines of a serving process, written in batches: a line logged on a running event
    loop is buffered and the buffer written at the end of the loop's current turn (one
    ``call_soon``), one ``write`` and ``flush`` per ``BATCH_BYTES`` instead of one a line (two
    log lines a request each cost a ``write`` system call: the decision log is kept, its
    system calls are shared). A line logged where no loop runs (a thread, start-up) writes what
    is buffered and itself at once, in order. Buffered lines are written at exit (``atexit``);
    a forked child starts with an empty buffer (the parent writes its own)."""

    def __init__(self, file: TextIO) -> None:
        self._file = file
        self._lines: list[str] = []
        self._size = 0
        self._scheduled = False
        self._lock = threading.Lock()
        atexit.register(self.flush)
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self._lines, self._size, self._scheduled = [], 0, False
        self._lock = threading.Lock()

    def add(self, line: str) -> None:
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self._lock:
            self._lines.append(line)
            self._size += len(line)
            if loop is None or self._size >= BATCH_BYTES:
                self._write()
            elif not self._scheduled:
                self._scheduled = True
                loop.call_soon(self.flush)

    def flush(self) -> None:
        with self._lock:
            self._write()

    def _write(self) -> None:  # under the lock
        self._scheduled = False
        lines, self._lines, self._size = self._lines, [], 0
        batch: list[str] = []
        size = 0
        for line in lines:
            if batch and size + len(line) > BATCH_BYTES:
                self._file.write("".join(batch))
                self._file.flush()
                batch, size = [], 0
            batch.append(line)
            size += len(line)
        if batch:
            self._file.write("".join(batch))
            self._file.flush()


class BatchedLogger:
    """structlog's ``WriteLogger`` over a ``BatchedLines``: every level writes the line."""

    __slots__ = ("_lines",)

    def __init__(self, lines: BatchedLines) -> None:
        self._lines = lines

    def msg(self, message: str) -> None:
        self._lines.add(message + "\n")

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


class BatchedLoggerFactory:
    def __init__(self, file: TextIO) -> None:
        self.lines = BatchedLines(file)

    def __call__(self, *args: Any) -> BatchedLogger:
        return BatchedLogger(self.lines)


def _json_bound_logger(min_level: int) -> type[Logger]:
    """structlog's filtering bound logger for ``min_level``, whose ``info`` (the decision log's
    two events a request) renders through a lone ``JsonLine`` itself: the event dict structlog
    would build (the bound context, the fields, ``event`` last), the line, the logger's
    ``info``. structlog's path to the same line is four calls more (the level method, the
    interpolation check, the proxy, the chain loop). With other processors (a test capturing
    events), positional arguments or ``info`` filtered out, structlog's own method runs."""
    base = structlog.make_filtering_bound_logger(min_level)
    if min_level > logging.INFO:
        return base

    class JsonBoundLogger(base):  # type: ignore[valid-type, misc]
        def info(self, event: str, *args: Any, **kw: Any) -> Any:
            processors = self._processors
            if args or len(processors) != 1 or type(processors[0]) is not JsonLine:
                return super().info(event, *args, **kw)
            event_dict = self._context.copy()
            event_dict.update(kw)
            event_dict["event"] = event
            return self._logger.info(processors[0](self._logger, "info", event_dict))

    return JsonBoundLogger


def configure_logging(
    level: str = "info", json_output: bool = True, *, cache: bool = False, batch: bool = False
) -> None:
    """Configure structlog for the process: JSON lines to stdout, or a console renderer.

    ``cache=True`` (``shapegate serve``: configured once per process) lets each logger keep
    what it assembled on first use instead of binding a new one at every event, two of them per
    request; tests reconfigure between cases and keep the default. ``batch=True`` (a serving
    process) writes the lines in batches (``BatchedLines``)."""
    processors: list[Any] = (
        [JsonLine()]
        if json_output
        else [
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            UtcStamper(),
            structlog.dev.ConsoleRenderer(colors=False),
        ]
    )
    structlog.configure(
        processors=processors,
        wrapper_class=(
            _json_bound_logger(_LEVELS[level])
            if json_output
            else structlog.make_filtering_bound_logger(_LEVELS[level])
        ),
        logger_factory=(
            BatchedLoggerFactory(sys.stdout)
            if batch
            else structlog.WriteLoggerFactory(file=sys.stdout)
        ),
        cache_logger_on_first_use=cache,
    )


def get_logger(component: str) -> Logger:
    logger: Logger = structlog.get_logger(component=component)
    return logger


def assembled(log: Logger) -> Logger:
    """The logger ``log`` stands for, assembled now where loggers are cached (``shapegate serve``
    configures once: ``configure_logging(cache=True)``), so a hot caller skips the lazy proxy's
    ``__getattr__`` and ``bind`` (two calls an event: the recorder logs two events a request).
    The proxy would keep the same logger on first use. ``log`` itself otherwise: tests configure
    logging between cases, and an assembled logger keeps the configuration it was made with."""
    if structlog.get_config()["cache_logger_on_first_use"] is True:
        bound: Logger = log.bind()
        return bound
    return log


def swallowed(
    log: Logger,
    metrics: Metrics | None,
    where: str,
    exc: BaseException,
    decision: str,
    **fields: Any,
) -> None:
    """Record an exception that is handled without re-raising, and the decision it caused."""
    log.warning(
        "error.swallowed",
        where=where,
        error_type=type(exc).__name__,
        error=str(exc)[:500],
        decision=decision,
        **fields,
    )
    if metrics is not None:
        metrics.swallowed_errors.labels(where=where).inc()
        metrics.events.add("swallowed", where, f"{type(exc).__name__}: {exc}", decision, fields)
