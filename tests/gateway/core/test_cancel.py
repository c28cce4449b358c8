"""The asyncio-native cancel scope the request path enters (gateway/core/cancel.py)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.core.cancel import CancelScope


async def test_a_cancel_from_another_task_ends_the_body_and_is_caught() -> None:
    scope = CancelScope()
    reached_end = False

    async def body() -> None:
        nonlocal reached_end
        with scope:
            await asyncio.sleep(10)
            reached_end = True

    task = asyncio.get_running_loop().create_task(body())
    await asyncio.sleep(0)
    scope.cancel()
    await task  # the cancellation stays inside the scope: the task ends normally
    assert scope.cancelled_caught and not reached_end
    assert task.cancelling() == 0


async def test_an_uncancelled_scope_changes_nothing() -> None:
    with CancelScope() as scope:
        await asyncio.sleep(0)
    assert not scope.cancelled_caught and not scope.cancel_called
    scope.cancel()  # after the exit: nothing to cancel, and the task is not cancelled later
    await asyncio.sleep(0)
    assert not scope.cancelled_caught


async def test_the_deadline_cancels_the_body_and_an_early_exit_disarms_it() -> None:
    with CancelScope(deadline_s=0.01) as late:
        await asyncio.sleep(10)
    assert late.cancelled_caught
    with CancelScope(deadline_s=0.05) as early:
        await asyncio.sleep(0)
    await asyncio.sleep(0.1)  # the disarmed deadline cancels nothing after the exit
    assert not early.cancelled_caught and not early.cancel_called


async def sleeping_in(scope: CancelScope) -> asyncio.Task[None]:
    """A task asleep inside ``scope`` (started: its first await reached)."""

    async def body() -> None:
        with scope:
            await asyncio.sleep(10)

    task = asyncio.get_running_loop().create_task(body())
    await asyncio.sleep(0)
    return task


async def test_a_cancellation_from_outside_passes_through() -> None:
    scope = CancelScope()
    task = await sleeping_in(scope)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not scope.cancelled_caught


async def test_its_own_cancel_and_one_from_outside_together_propagate() -> None:
    scope = CancelScope()
    task = await sleeping_in(scope)
    scope.cancel()
    task.cancel()  # e.g. the server's shutdown: not the scope's to swallow
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not scope.cancelled_caught


async def test_a_cancel_before_the_enter_lands_at_the_first_await() -> None:
    scope = CancelScope()
    scope.cancel()
    with scope:
        await asyncio.sleep(10)
    assert scope.cancelled_caught


async def test_it_is_entered_inside_a_task_only() -> None:
    loop = asyncio.get_running_loop()
    raised: asyncio.Future[BaseException] = loop.create_future()

    def outside_a_task() -> None:  # a loop callback: no current task
        try:
            CancelScope().__enter__()
        except RuntimeError as exc:
            raised.set_result(exc)

    loop.call_soon(outside_a_task)
    assert "inside a task" in str(await raised)


async def test_a_deadline_scope_asks_for_the_running_loop_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In Python 3.11 each ``get_running_loop`` is a getpid system call; the scope made with a
    deadline already knows its loop when it is entered."""
    asked: list[None] = []
    real = asyncio.events.get_running_loop

    def counting() -> asyncio.AbstractEventLoop:
        asked.append(None)
        return real()

    monkeypatch.setattr(asyncio.events, "get_running_loop", counting)
    monkeypatch.setattr(asyncio, "get_running_loop", counting)
    with CancelScope(deadline_s=5.0) as scope:
        await asyncio.sleep(0)
    assert not scope.cancelled_caught
    assert len(asked) == 1
