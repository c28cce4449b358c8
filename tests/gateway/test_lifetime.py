"""gateway/lifetime.py: a retired resource closes once, after its last user left (InUse); the
heap start-up freed goes back to the system (trim_heap); a process can refuse transparent huge
pages (no_huge_pages)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from gateway.lifetime import InUse, in_thread, no_huge_pages, trim_heap


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


def rss_mb() -> float:
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="Linux only")
def test_trim_heap_gives_freed_memory_back_to_the_system() -> None:
    """200 MB freed in blocks below malloc's mmap threshold stays resident until trimmed: what
    a tokenizer's load and warm-up leave behind."""
    blocks = [bytearray(50_000) for _ in range(4000)]
    last = bytearray(50_000)  # alive above the freed blocks: nothing is freed from the top
    del blocks
    freed = rss_mb()
    assert trim_heap()
    assert freed - rss_mb() > 100, "the freed blocks are still resident"
    assert len(last) == 50_000


@pytest.mark.skipif(
    "THP_enabled" not in (Path("/proc/self/status").read_text() if Path("/proc").exists() else ""),
    reason="Linux with transparent huge pages only",
)
def test_no_huge_pages_holds_for_the_process_and_its_forks() -> None:
    """Set in a fork (as a counting child does), so this test process keeps its own setting."""
    ours = Path("/proc/self/status").read_text().split("THP_enabled:")[1].split()[0]
    pid = os.fork()
    if pid == 0:
        ok = no_huge_pages()
        status = Path("/proc/self/status").read_text()
        grandchild = os.fork()
        if grandchild == 0:
            os._exit(0 if "THP_enabled:\t0" in Path("/proc/self/status").read_text() else 2)
        _, inherited = os.waitpid(grandchild, 0)
        os._exit(0 if ok and "THP_enabled:\t0" in status and inherited == 0 else 1)
    _, code = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(code) == 0
    assert f"THP_enabled:\t{ours}" in Path("/proc/self/status").read_text()
