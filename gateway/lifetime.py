"""Closing a shared resource once the last request that uses it has finished; giving a
process's freed heap back after start-up.

A hot reload replaces the policy's token counter (or the tracing exporter) for new requests
while requests admitted under the old one still use it; closing it at once would fail them,
never closing it leaks its worker thread and tokenizer child process.

Contract of ``InUse``:
- ``enter()`` / ``leave()`` bracket each use (a request); calls are on the event loop thread.
- ``retire(close)`` runs ``close`` exactly once: at once when nothing uses the resource, else
  when the last use leaves. A retired resource may still be entered (a request that read the
  old policy just before the swap); ``close`` then waits for it too.
- ``close`` runs on the caller's thread: pass one that hands blocking work to a thread
  (``in_thread``), since ``leave`` runs on the event loop.

``trim_heap()``: start-up (a tokenizer's load, the warm-up's largest prompt) frees memory that
glibc keeps for reuse; trimming once it is over returns it, measured on the demo policy: the
tokenizer child 212 -> 183 MB, the gateway 82 -> 66 MB. Called by the gateway after start-up
and by each tokenizer child after its warm-up. Not glibc: nothing to trim.

``hold_heap(keep_mb)``: glibc serves an allocation above its (dynamic) mmap threshold with a
fresh ``mmap`` and returns it at ``free``, and trims the heap's free top past its trim
threshold; a monster's buffers (the body, its text, the pieces, the pickle to the tokenizer
child: megabytes each) then page-fault in anew on every request. Measured on a 4 x 237k-token
burst: 6,000-7,500 minor faults in the gateway on the first burst and 500-6,500 on each later
one; with the heap held, the first burst after the boot rehearsal
(``gateway/request/rehearsal.py``) and the later ones fault almost never. Buffers up to 32 MiB
come from the heap, and up to ``keep_mb`` of freed heap stays mapped for the next burst (the
memory a burst used, kept: the cost of not faulting it in again). Not glibc: nothing to set.

``no_huge_pages()``: this process's later allocations get no transparent huge pages (Linux's
``prctl(PR_SET_THP_DISABLE)``, kept across ``fork``; pages already mapped stay as they are).
gigatoken asks for huge pages (``madvise``) on its pre-token cache's table, which it doubles
as it fills: in a tokenizer child counting vocabulary-hostile text, each doubling faulted in
its new table 2 MiB at a time, and on this host (a KVM guest that hands free 2 MiB blocks
back to the hypervisor) each such fault cost ~4 ms of system time: measured on 200k-token
random-letter texts, the counts that doubled the table to 32, 64 and 128 MiB took 100, 200
and 310 ms of CPU (70, 160 and 260 of them system) against 20 ms for the others; with 4 KiB
pages 40, 60 and 90 ms (10, 30 and 40 system), the other counts as fast (the same median on
prose and letters). Called by each counting child after its fork. False where there is no
``prctl`` or it refused.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable


class InUse:
    __slots__ = ("_close", "users")

    def __init__(self) -> None:
        self.users = 0
        self._close: Callable[[], None] | None = None

    @property
    def retired(self) -> bool:
        return self._close is not None

    def enter(self) -> None:
        self.users += 1

    def leave(self) -> None:
        self.users -= 1
        if self.users == 0 and self._close is not None:
            self._run()

    def retire(self, close: Callable[[], None]) -> None:
        if self._close is not None:
            return
        self._close = close
        if self.users == 0:
            self._run()

    def _run(self) -> None:
        close, self._close = self._close, lambda: None  # once, and still "retired"
        if close is not None:
            close()


def in_thread(work: Callable[[], None], name: str) -> Callable[[], None]:
    """``work`` started in a daemon thread: a close that joins threads or waits for a child
    process must not block the event loop."""
    return lambda: threading.Thread(target=work, name=name, daemon=True).start()


def trim_heap() -> bool:
    """Return the freed heap to the system (glibc's ``malloc_trim``); False where there is none."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    trim = getattr(libc, "malloc_trim", None)
    return bool(trim is not None and trim(0))


# linux/prctl.h
_PR_SET_THP_DISABLE = 41


def no_huge_pages() -> bool:
    """No transparent huge pages for this process's later allocations; False where Linux's
    ``prctl`` is missing or refused."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    prctl = getattr(libc, "prctl", None)
    return bool(prctl is not None and prctl(_PR_SET_THP_DISABLE, 1, 0, 0, 0) == 0)


# glibc's mallopt parameters (malloc.h) and its largest mmap threshold on 64-bit (32 MiB).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 2**20


def hold_heap(keep_mb: int) -> bool:
    """Serve buffers up to 32 MiB from the heap and keep up to ``keep_mb`` of freed heap mapped
    (glibc's ``mallopt``); False where there is no glibc or it refused."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    return bool(
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
        and mallopt(_M_TRIM_THRESHOLD, keep_mb * 2**20)
    )
