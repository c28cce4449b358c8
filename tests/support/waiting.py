"""Wait for a condition with a deadline, instead of sleeping for a guess of how long it takes."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def wait_for(
    condition: Callable[[], T | Awaitable[T]],
    timeout: float,
    *,
    interval: float = 0.01,
    what: str = "",
) -> T:
    """Call ``condition`` (plain or async) every ``interval`` s until it returns something truthy
    and return that; fail the test with ``what`` and the last value after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise AssertionError(
                f"not within {timeout:g}s: {what or condition!r} (last: {value!r})"
            )
        await asyncio.sleep(interval)
