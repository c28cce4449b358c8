"""A cancel scope on asyncio's own task cancellation, for the scopes every request enters.

    with CancelScope() as scope:          # scope.cancel() from anywhere on the loop
        ...                               # (another task, a callback) cancels the body
    scope.cancelled_caught                # True when the body ended by that cancellation

    with CancelScope(deadline_s=2.5) as scope:   # cancelled when the seconds run out too
        ...

The request path entered three anyio cancel scopes a request (the client-disconnect scope, the
engine-down scope of an attempt, the watchdog's deadline around an upstream wait); anyio's
look up the async backend and the task's state on every enter and exit, and the overhead
benchmark's deterministic profile put the three at about 5% of a request's CPU. This one is
what ``asyncio.timeout`` does (``Task.cancel`` and ``Task.uncancel``, so a cancellation from
outside the scope passes through it untouched), with a ``cancel()`` of its own.

One difference from anyio's scopes, which is why the pipeline keeps anyio's around a slot held
in a shared store: a cancellation here is delivered once (at the next await inside the scope),
not at every await until the scope exits, and an ``anyio.CancelScope(shield=True)`` inside does
not hold it off. Use it only where nothing inside is shielded.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

_IDLE, _ENTERED, _CANCELLING, _EXITED = 0, 1, 2, 3


class CancelScope:
    __slots__ = (
        "_cancelling",
        "_handle",
        "_loop",
        "_state",
        "_task",
        "cancel_called",
        "cancelled_caught",
    )

    def __init__(
        self, deadline_s: float | None = None, loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        self._task: asyncio.Task[object] | None = None
        self._state = _IDLE
        self._cancelling = 0
        self.cancel_called = False
        self.cancelled_caught = False
        self._handle: asyncio.TimerHandle | None = None
        # The loop, when known (given: the running one, which the caller already holds), finds
        # the task without asking for the running loop again: in Python 3.11 every
        # ``get_running_loop`` (``current_task`` asks too) is a getpid system call.
        self._loop = loop
        if deadline_s is not None:
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            self._handle = loop.call_at(loop.time() + max(deadline_s, 0.0), self.cancel)

    def __enter__(self) -> CancelScope:
        task = asyncio.current_task(self._loop)
        if task is None:
            raise RuntimeError("CancelScope is entered inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._state = _ENTERED
        if self.cancel_called:  # cancelled before it was entered: at the first await inside
            self._deliver()
        return self

    def cancel(self) -> None:
        """Cancel the body (at its next await); nothing once the scope has exited."""
        if self.cancel_called:
            return
        self.cancel_called = True
        if self._state == _ENTERED:
            self._deliver()

    def _deliver(self) -> None:
        assert self._task is not None
        self._state = _CANCELLING
        self._task.cancel()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        state, self._state = self._state, _EXITED
        if state != _CANCELLING:
            return False
        assert self._task is not None
        # Ours only when no other cancellation is on its way (asyncio.timeout's rule).
        if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            self.cancelled_caught = True
            return True
        return False
