"""InUse (gateway/lifetime.py): a retired resource closes once, after its last user left."""

from __future__ import annotations

import threading

from gateway.lifetime import InUse, in_thread


def test_retire_closes_at_once_when_unused_and_only_once() -> None:
    closed: list[str] = []
    use = InUse()
    use.retire(lambda: closed.append("x"))
    use.retire(lambda: closed.append("y"))
    use.enter()
    use.leave()
    assert closed == ["x"]


def test_retire_waits_for_the_last_user_even_one_that_entered_late() -> None:
    closed: list[str] = []
    use = InUse()
    use.enter()
    use.retire(lambda: closed.append("x"))
    use.enter()  # read the old policy just before the swap
    use.leave()
    assert closed == []
    use.leave()
    assert closed == ["x"]
    assert use.retired


def test_in_thread_runs_the_work_off_the_callers_thread() -> None:
    ran = threading.Event()
    where: list[str] = []

    def work() -> None:
        where.append(threading.current_thread().name)
        ran.set()

    in_thread(work, "closer")()
    assert ran.wait(5) and where == ["closer"]
