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

import logging
import sys
from typing import TYPE_CHECKING, Any

import orjson
import structlog

if TYPE_CHECKING:
    from gateway.metrics import Metrics

Logger = structlog.typing.FilteringBoundLogger

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def _dumps(obj: Any, default: Any = None) -> str:
    return orjson.dumps(obj, default=default or str).decode()


def configure_logging(
    level: str = "info", json_output: bool = True, *, cache: bool = False
) -> None:
    """Configure structlog for the process: JSON lines to stdout, or a console renderer.

    ``cache=True`` (``shapegate serve``: configured once per process) lets each logger keep
    what it assembled on first use instead of binding a new one at every event, two of them per
    request; tests reconfigure between cases and keep the default."""
    renderer: Any = (
        structlog.processors.JSONRenderer(serializer=_dumps)
        if json_output
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.WriteLoggerFactory(file=sys.stdout),
        cache_logger_on_first_use=cache,
    )


def get_logger(component: str) -> Logger:
    logger: Logger = structlog.get_logger(component=component)
    return logger


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
