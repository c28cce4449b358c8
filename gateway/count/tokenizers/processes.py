"""The tokenizer's processes: the template and the counting children forked from it.

``start_template`` starts the template, a fresh interpreter (``python -m
gateway.count.tokenizers.child READ_FD WRITE_FD CONTROL_FD``: child.py), not a fork or a
multiprocessing spawn of the gateway: nothing of the gateway is copied or re-imported into it.
It loads the recipe's tokenizer once, warms it (``tokenizers/warmup.py``) and never counts.
``fork`` asks it, over its control socket, for a counting child: an ``os.fork`` of the template
(the loaded tokenizer shared copy-on-write), handed its own pipe ends, then rehearsed through
that pipe as a request's count goes (``_rehearse``, ``warmup.rehearsal_text``) before it takes
a call. Pipes are widened to ``PIPE_BYTES`` where Linux allows it. ``stop_child`` closes the
pipes and kills: a child holds nothing worth a graceful exit. A forked child is not this
process's child (the template reaps it), so it is watched by pid (``_Forked``).
Events: ``tokenizer.template_ready`` (pid, warm_chars, warm_ms, load_s),
``tokenizer.child_warmed`` (pid, template_pid, warm_chars, fork_ms, pipe_ms),
``tokenizer.pipe_default`` (error).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import sendfds

from gateway.count.tokenizers.encoders import Encoder
from gateway.count.tokenizers.warmup import rehearsal_text
from gateway.observe.log import get_logger

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
class Child:
    process: subprocess.Popen[bytes] | _Forked
    send: Connection
    recv: Connection
    rss_mb: float
    started: float
    calls: int = 0
    ready_rss_mb: float = 0.0


@dataclass(slots=True)
class Template:
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


def start_template(recipe: Callable[[], Encoder], warm_chars: int) -> Template:
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
    return Template(process, send, recv, ours)


def fork(template: Template, warm_chars: int) -> Child:
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
    child = Child(
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


def _rehearse(child: Child, chars: int) -> float:
    """One count of a ``chars``-character text through the pipe, as a request's goes (a text no
    cache holds); its time in ms. The child is stopped and ``EncoderFailed`` raised if it fails."""
    started = time.perf_counter()
    try:
        child.send.send(("count", [rehearsal_text(max(chars, 1), child.process.pid)]))
        status, detail, rss = child.recv.recv()
    except (EOFError, OSError) as exc:
        stop_child(child)
        raise EncoderFailed(f"tokenizer child exited in its rehearsal: {exc!r}") from exc
    if status != "ok":
        stop_child(child)
        raise EncoderFailed(f"tokenizer child failed its rehearsal: {detail}")
    child.rss_mb = rss
    return (time.perf_counter() - started) * 1000


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


def stop_child(child: Child | Template) -> None:
    """Close the pipe and kill: a child holds nothing worth a graceful exit, and its memory
    goes back to the system at once. A template's counting children are not its: each is
    stopped on its own (and ends by itself when its pipe closes)."""
    child.send.close()
    child.recv.close()
    if isinstance(child, Template):
        child.control.close()
    if child.process.poll() is None:
        child.process.kill()
    child.process.wait(timeout=10)


def stop_all(children: list[Child | Template]) -> None:
    for child in children:
        stop_child(child)
