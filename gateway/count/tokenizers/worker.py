"""A tokenizer in a child process, replaced when its memory passes a bound.

Why, for gigatoken 0.10.0 (the official package) keeps every distinct pre-token it has encoded in a
cache inside the tokenizer, with no bound and no way to clear it; text made of ever-new pieces
(random CJK, base64) grows it by 3-6 MB per MB of text. Loading a fresh tokenizer in the
gateway's own process would hold the GIL for ~1.3 s (the event loop stalls), and the allocator
keeps part of what the old one freed. A child process gives both back: it loads off the
gateway's GIL, and its memory returns to the system when it exits. The child is a fresh
interpreter (``python -m gateway.count.tokenizers.child READ_FD WRITE_FD``: child.py), not a
fork or a multiprocessing spawn: nothing of the gateway is copied or re-imported into it.
tiktoken runs
here too when it stands in for gigatoken on a tokenizer.json (``byte_level.py``): building its
ranks parses the whole vocabulary (0.7 s, ~100 MB), which the gateway's loop never pays.

Contract of ``ChildEncoder`` (an ``Encoder`` with the backend of its recipe):
- ``encode``, ``decode``, ``count_many``, ``try_count_many`` answer exactly what the same
  encoder answers in-process (the child runs what the recipe builds; ``decode``'s
  ``ValueError`` for an id outside the vocabulary is raised here as the same); calls are
  serialised by ``lock``, the calling thread waits on a pipe without holding the GIL.
- Each answer carries the child's resident memory. Past ``max_rss_mb`` (at least
  ``READY_HEADROOM`` x what the child held once loaded, or it would be replaced on every call)
  a replacement is started in the background: it loads and warms the tokenizer in its own
  process while the old child keeps answering, and takes over at the first call after it is
  ready; the old child is then stopped. A count never waits for a load: for the time of one
  load the tokenizer holds two children, the old one (past the bound by what it grew during
  that load) and the fresh one (what a loaded, warmed child holds). A replacement that fails
  to load is logged as swallowed and the old child keeps serving; the next call past the bound
  starts another.
- A child that died (killed, crashed) is replaced before the call is retried once; a failure
  raised inside the child is raised here as ``EncoderFailed``.
- Every child, the first and each replacement, encodes ``warm_chars`` characters before it
  answers ready (``tokenizers/warmup.py``), then counts one text as large sent through the
  pipe as requests' are (``_rehearse``: the pickle, both pipe ends, the child's heap grown to a
  monster's size and held there, ``hold_heap``), all before it takes any request's count: the
  first monster after a recycle is as fast as the tenth. The ready reply carries the warm-up's
  time, logged as ``tokenizer.child_warmed`` with the pipe round trip's (``pipe_ms``).
- ``close()`` stops the child; so does garbage collection of the encoder, and the child exits
  by itself when the gateway's end of the pipe closes (the gateway died).
Events: ``tokenizer.child_warmed`` (pid, warm_chars, warm_ms, pipe_ms),
``tokenizer.recycle_started`` (rss_mb), ``tokenizer.recycled`` (old_rss_mb, calls, load_s),
``tokenizer.child_lost`` (via ``swallowed``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import sendfds
from typing import TYPE_CHECKING, Any

from gateway.count.tokenizers.child import warm_text
from gateway.count.tokenizers.encoders import Backend, Encoder
from gateway.observe.log import get_logger, swallowed

if TYPE_CHECKING:
    from gateway.observe.metrics import Metrics

# The bound is at least this much above what a freshly loaded child holds.
READY_HEADROOM = 1.25
READY_TIMEOUT_S = 120.0


class EncoderFailed(RuntimeError):
    """The tokenizer in the child process raised, or no child could be started."""


class _Forked:
    """A counting child forked by the template: not this process's child (the template reaps
    it), so it is watched by pid, with ``subprocess.Popen``'s ``pid``, ``poll``, ``kill`` and
    ``wait``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def poll(self) -> int | None:
        return None if _running(self.pid) else -signal.SIGKILL

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # it ended: nothing to stop
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while _running(self.pid):
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"tokenizer child {self.pid}", timeout)
            time.sleep(0.005)
        return -signal.SIGKILL


def _running(pid: int) -> bool:
    """Alive: a zombie (ended, its parent not yet told) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: whether the pid still names a process
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


@dataclass(slots=True)
class _Child:
    process: subprocess.Popen[bytes] | _Forked
    send: Connection
    recv: Connection
    rss_mb: float
    started: float
    calls: int = 0
    ready_rss_mb: float = 0.0


@dataclass(slots=True)
class _Template:
    """The tokenizer loaded and warmed once, in a process that never counts: every counting
    child is a fork of it (child.py, ``_serve_template``)."""

    process: subprocess.Popen[bytes]
    send: Connection
    recv: Connection
    control: socket.socket


def _launch(
    recipe: Callable[[], Encoder], warm_chars: int, control: socket.socket
) -> tuple[subprocess.Popen[bytes], Connection, Connection, float]:
    """Start the template, a fresh interpreter running child.py (nothing of this process is
    forked or re-imported), send it the recipe and wait until its tokenizer is loaded and warm:
    its process, pipe ends and warm-up ms. ``EncoderFailed`` (the process stopped) if it does
    not get there."""
    child_reads, to_child = os.pipe()  # (read end, write end); ours are not inherited
    from_child, child_writes = os.pipe()
    _widen(to_child)
    _widen(from_child)
    fds = (child_reads, child_writes, control.fileno())
    process = subprocess.Popen(  # noqa: S603 - our own interpreter and module
        [sys.executable, "-m", "gateway.count.tokenizers.child", *(str(fd) for fd in fds)],
        pass_fds=fds,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )
    os.close(child_reads)
    os.close(child_writes)
    send, recv = Connection(to_child, readable=False), Connection(from_child, writable=False)

    def stop() -> None:
        send.close()
        recv.close()
        process.kill()
        process.wait(timeout=10)

    try:
        send.send((recipe, warm_chars))
        if not recv.poll(READY_TIMEOUT_S):
            raise EncoderFailed(f"tokenizer child not ready within {READY_TIMEOUT_S:g}s")
        status, detail, _rss = recv.recv()
    except (EOFError, OSError) as exc:
        stop()
        raise EncoderFailed(f"tokenizer child exited while loading: {exc!r}") from exc
    except EncoderFailed:
        stop()
        raise
    if status != "ready":
        stop()
        raise EncoderFailed(f"tokenizer child failed to load: {detail}")
    return process, send, recv, float(detail)


def _start_template(recipe: Callable[[], Encoder], warm_chars: int) -> _Template:
    """Start the template (a fresh interpreter) and wait until its tokenizer is loaded and warm
    (``tokenizer.template_ready``: pid, warm_chars, warm_ms, load_s)."""
    started = time.monotonic()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        process, send, recv, warm_ms = _launch(recipe, warm_chars, theirs)
    except EncoderFailed:
        ours.close()
        raise
    finally:
        theirs.close()
    get_logger("tokens").info(
        "tokenizer.template_ready",
        pid=process.pid,
        warm_chars=warm_chars,
        warm_ms=round(warm_ms, 1),
        load_s=round(time.monotonic() - started, 2),
    )
    return _Template(process, send, recv, ours)


def _fork(template: _Template, warm_chars: int) -> _Child:
    """A counting child forked from the template, rehearsed through its pipe as a request's
    count goes (``tokenizer.child_warmed``: pid, template_pid, fork_ms, pipe_ms).
    ``EncoderFailed`` if the template or the child is gone."""
    started = time.monotonic()
    child_reads, to_child = os.pipe()
    from_child, child_writes = os.pipe()
    _widen(to_child)
    _widen(from_child)
    try:
        # One fork at a time: the caller holds ChildEncoder._spawning (or is its constructor).
        sendfds(template.control, [child_reads, child_writes])
        if not template.recv.poll(READY_TIMEOUT_S):
            raise EncoderFailed(f"tokenizer template did not fork within {READY_TIMEOUT_S:g}s")
        status, pid = template.recv.recv()
        if status != "forked":
            raise EncoderFailed(f"tokenizer template answered {status!r}")
    except (EOFError, OSError, EncoderFailed) as exc:
        os.close(to_child)
        os.close(from_child)
        if isinstance(exc, EncoderFailed):
            raise
        raise EncoderFailed(f"tokenizer template gone: {exc!r}") from exc
    finally:  # the template holds copies (and its child the only ones it keeps)
        os.close(child_reads)
        os.close(child_writes)
    child = _Child(
        _Forked(pid),
        Connection(to_child, readable=False),
        Connection(from_child, writable=False),
        0,
        started,
    )
    fork_ms = (time.monotonic() - started) * 1000
    pipe_ms = _rehearse(child, warm_chars)
    child.ready_rss_mb = child.rss_mb
    get_logger("tokens").info(
        "tokenizer.child_warmed",
        pid=pid,
        template_pid=template.process.pid,
        warm_chars=warm_chars,
        fork_ms=round(fork_ms, 1),
        pipe_ms=round(pipe_ms, 1),
    )
    return child


def _rehearse(child: _Child, chars: int) -> float:
    """One count of a ``chars``-character text through the pipe, as a request's goes (a text no
    cache holds); its time in ms. The child is stopped and ``EncoderFailed`` raised if it fails."""
    started = time.perf_counter()
    try:
        child.send.send(("count", [rehearsal_text(max(chars, 1), child.process.pid)]))
        status, detail, rss = child.recv.recv()
    except (EOFError, OSError) as exc:
        _stop(child)
        raise EncoderFailed(f"tokenizer child exited in its rehearsal: {exc!r}") from exc
    if status != "ok":
        _stop(child)
        raise EncoderFailed(f"tokenizer child failed its rehearsal: {detail}")
    child.rss_mb = rss
    return (time.perf_counter() - started) * 1000


def rehearsal_text(chars: int, index: int) -> str:
    """A text of about ``chars`` characters, different for each ``index``: no count cache holds
    it, so it takes the path a new prompt takes. It opens with up to ``NEW_WORD_CHARS`` of words
    the tokenizer has not seen (``new_words``), then ``warm_text``'s mix: a new prompt's words
    grow gigatoken's pre-token cache, and the first ones after a fork copy the template's pages
    they write to (and may grow the table): that happens here, not in a request's count."""
    head = f"rehearsal {index:x}: "
    words = new_words(min(max(0, chars - len(head)), NEW_WORD_CHARS), index)
    return head + words + warm_text(max(0, chars - len(head) - len(words)))


# Measured on Qwen3.6 after a fork (2026-12-05): the first 200k-token prose count took 20 ms
# against 4-6 ms later ones (3,100 page faults); after ~50,000 new words in the rehearsal
# (330 kB) 9 ms, after 20,000 no better than none. 400 kB is ~60,000 words, under 0.1 s.
NEW_WORD_CHARS = 400_000
_LETTERS = bytes(32 if i % 8 == 0 else 97 + i % 26 for i in range(256))  # space, a-z


def new_words(chars: int, seed: int) -> str:
    """``chars`` characters of random lower-case words (a space about every 8th character),
    the same for the same seed; made at C speed (bytes.translate), so the recycle thread holds
    the GIL for well under a millisecond."""
    return random.Random(seed).randbytes(chars).translate(_LETTERS).decode("ascii")


# A pipe holds 64 kB by default: a 130 kB prompt would take several wake-ups of each side to
# cross, and on a busy host every wake-up waits for a CPU. Linux lets a pipe grow to
# /proc/sys/fs/pipe-max-size (1 MiB by default) without privileges.
PIPE_BYTES = 1 << 20


def _widen(fd: int) -> None:
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None)  # Linux only
    if set_size is None:
        return
    try:
        with open("/proc/sys/fs/pipe-max-size", "rb") as limit:
            size = min(PIPE_BYTES, int(limit.read()))
        fcntl.fcntl(fd, set_size, size)
    except OSError as exc:  # a smaller limit, or none: the default 64 kB pipe still works
        get_logger("tokens").info("tokenizer.pipe_default", error=str(exc))


def _stop(child: _Child | _Template) -> None:
    """Close the pipe and kill: a child holds nothing worth a graceful exit, and its memory
    goes back to the system at once. A template's counting children are not its: each is
    stopped on its own (and ends by itself when its pipe closes)."""
    child.send.close()
    child.recv.close()
    if isinstance(child, _Template):
        child.control.close()
    if child.process.poll() is None:
        child.process.kill()
    child.process.wait(timeout=10)


class ChildEncoder:
    out_of_process = True

    def __init__(
        self,
        recipe: Callable[[], Encoder],
        *,
        backend: Backend,
        max_rss_mb: float,
        metrics: Metrics | None = None,
        warm_chars: int = 0,
    ) -> None:
        """``recipe`` builds the in-process encoder (of ``backend``) in the template: a
        picklable callable; the template encodes ``warm_chars`` characters before it answers
        ready, and each counting child counts a text as large through its pipe before it takes
        a call."""
        self._recipe = recipe
        self.backend = backend
        self.warm_chars = warm_chars
        self._metrics = metrics
        self.max_rss_mb = max_rss_mb
        self.lock = threading.Lock()
        self.recycles = 0
        self._log = get_logger("tokens")
        self._spawning = threading.Lock()  # one fork (or template restart) at a time
        self._template = _start_template(recipe, warm_chars)
        try:
            self._child = _fork(self._template, warm_chars)
        except EncoderFailed:
            _stop(self._template)
            raise
        self._next: _Child | None = None
        self._pending: threading.Thread | None = None
        self._stopped = self._arm()

    @property
    def rss_mb(self) -> float:
        """The child's resident memory after its last answer."""
        return self._child.rss_mb

    @property
    def pid(self) -> int:
        """The counting child's."""
        return self._child.process.pid

    @property
    def template_pid(self) -> int:
        return self._template.process.pid

    def encode(self, text: str) -> list[int]:
        with self.lock:
            ids: list[int] = self._call("encode", text)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        with self.lock:
            text: str = self._call("decode", list(ids))
        return text

    def count_many(self, texts: Sequence[str]) -> list[int]:
        with self.lock:
            return self._count(texts)

    def try_count_many(self, texts: Sequence[str]) -> list[int] | None:
        """Count now, or None if that would wait for another caller holding the child (the
        caller, the event loop, then hands the texts to a worker thread, which waits)."""
        if not self.lock.acquire(blocking=False):
            return None
        try:
            return self._count(texts)
        finally:
            self.lock.release()

    def close(self) -> None:
        with self.lock:
            if self._pending is not None:
                self._pending.join()
            self._stopped.detach()
            _stop_all([c for c in (self._child, self._next, self._template) if c is not None])

    # -- internals (the caller holds ``lock``) ----------------------------------------------

    def _count(self, texts: Sequence[str]) -> list[int]:
        counts: list[int] = self._call("count", list(texts))
        return counts

    def _call(self, op: str, arg: Any) -> Any:
        self._take_over()  # never waits: the old child answers until the replacement is ready
        try:
            status, result, rss = self._exchange(op, arg)
        except (EOFError, OSError) as exc:
            swallowed(
                self._log, self._metrics, "tokenizer.child", exc, "restarted_child_and_retried"
            )
            self._replace_now()
            status, result, rss = self._exchange(op, arg)
        self._child.rss_mb = rss
        self._child.calls += 1
        if status == "invalid":
            raise ValueError(result)
        if status != "ok":
            raise EncoderFailed(f"tokenizer failed: {result}")
        self._watch_memory()
        return result

    def _exchange(self, op: str, arg: Any) -> tuple[str, Any, float]:
        self._child.send.send((op, arg))
        reply: tuple[str, Any, float] = self._child.recv.recv()
        return reply

    @property
    def bound_mb(self) -> float:
        """The bound in force: ``max_rss_mb``, or more where the loaded tokenizer alone needs
        that much (a bound under it would replace the child on every call)."""
        return max(self.max_rss_mb, READY_HEADROOM * self._child.ready_rss_mb)

    def _watch_memory(self) -> None:
        rss, bound = self._child.rss_mb, self.bound_mb
        if rss <= bound:
            return
        if self._pending is None and self._next is None:
            self._log.info("tokenizer.recycle_started", rss_mb=round(rss, 1), bound_mb=bound)
            self._pending = threading.Thread(
                target=self._prepare, name="tokenizer-recycle", daemon=True
            )
            self._pending.start()

    def _prepare(self) -> None:
        try:
            self._next = self._spawn()
        except EncoderFailed as exc:
            swallowed(self._log, self._metrics, "tokenizer.recycle", exc, "kept_the_old_child")

    def _spawn(self) -> _Child:
        """A counting child forked from the template; a template that is gone (killed, crashed)
        is started again first (a full load, the only one after boot)."""
        with self._spawning:
            try:
                return _fork(self._template, self.warm_chars)
            except EncoderFailed as exc:
                if self._template.process.poll() is None:
                    raise  # the template lives: the fork or the child failed
                swallowed(
                    self._log, self._metrics, "tokenizer.template", exc, "restarted_the_template"
                )
                old, self._template = self._template, _start_template(self._recipe, self.warm_chars)
                _stop(old)
                self._stopped.detach()
                self._stopped = self._arm()
                return _fork(self._template, self.warm_chars)

    def _arm(self) -> weakref.finalize[Any, Any]:
        """Stop the counting child and the template when this encoder is collected."""
        return weakref.finalize(self, _stop_all, [self._child, self._template])

    def _take_over(self) -> None:
        if self._pending is not None and not self._pending.is_alive():
            self._pending = None
        if self._next is None or self._pending is not None:
            return
        old, self._child, self._next = self._child, self._next, None
        self.recycles += 1
        self._stopped.detach()
        self._stopped = self._arm()
        self._log.info(
            "tokenizer.recycled",
            old_rss_mb=round(old.rss_mb, 1),
            calls=old.calls,
            load_s=round(time.monotonic() - self._child.started, 2),
        )
        threading.Thread(target=_stop, args=(old,), name="tokenizer-stop", daemon=True).start()

    def _replace_now(self) -> None:
        old = self._child
        self._child = self._spawn()
        self._stopped.detach()
        self._stopped = self._arm()
        _stop(old)


def _stop_all(children: list[_Child | _Template]) -> None:
    for child in children:
        _stop(child)
