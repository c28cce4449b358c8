"""What runs in the tokenizer's processes. processes.py starts one, the template (a fresh
interpreter: ``python -m gateway.count.tokenizers.child READ_FD WRITE_FD CONTROL_FD``): it reads
the recipe, builds the encoder, warms it and answers ``ready``, then never counts. Each pair of
pipe ends the gateway passes over the control socket (``SCM_RIGHTS``,
``multiprocessing.reduction.sendfds``) becomes a counting child by ``os.fork``: the loaded,
warmed tokenizer is copied on write, so a replacement costs a fork (milliseconds) instead of a
load (about a second of CPU, several on a busy core, taken from the counts the old child is
still answering). The template answers ``("forked", pid)``, reaps its children (so their CPU
time is accounted to it) and exits when the gateway closes the control socket. A counting child
answers calls until the gateway closes its end of the pipe; every answer carries its resident
memory, which worker.py's bound watches.

Safe to fork: the template is single-threaded but for numpy's BLAS pool (which registers its own
fork handlers); gigatoken's parallel pool, which a fork would leave without threads, is never
touched (every count passes ``parallel=False``, encoders.py). A counting child refuses
transparent huge pages for what it allocates from then on (``lifetime.no_huge_pages``; the
template's stay shared as they are): gigatoken's pre-token cache doubles its table as new words
arrive, and faulting each new table in 2 MiB pages made those counts 3-5x slower (measured
there).

The recipes (``gigatoken_from_json``, ``gigatoken_from_tiktoken``) are built in the gateway and
called here: picklable, and the 13 MB of a tokenizer.json never parsed in the gateway.

Wire, one pickled tuple each way. Template: ``(recipe, warm_chars)`` then ``("ready", warm_ms,
rss)`` or ``("failed", why, rss)``; then for each pair of fds received ``("forked", pid)``. A
counting child, per call: ``(op, arg)`` (``encode``, ``decode``, ``count``) and ``("ok", result,
rss)``, ``("invalid", why, rss)`` (a ``decode`` of an id outside the vocabulary) or
``("failed", why, rss)``.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import recvfds
from typing import Any

from gateway.count.tokenizers.encoders import Encoder, GigatokenEncoder
from gateway.lifetime import hold_heap, no_huge_pages, trim_heap

# Freed heap a child keeps mapped for the next monster (lifetime.hold_heap); its RSS, which
# the bound watches, includes it.
CHILD_KEEP_MB = 32
_WARM_TEXT = 'warm 日本語 🎉 e\u0301 {"k": [1, 2]}\n' * 64


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm", "rb") as statm:
            pages = int(statm.read().split()[1])
    except OSError:
        import resource  # not Linux: the peak, which still trips the bound

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return pages * os.sysconf("SC_PAGE_SIZE") / (1024 * 1024)


def _answer(encoder: Encoder, op: str, arg: Any) -> Any:
    if op == "encode":
        return encoder.encode(arg)
    if op == "decode":
        return encoder.decode(arg)
    return encoder.count_many(arg)


def _load(inbox: Connection, outbox: Connection) -> Encoder | None:
    """Read the recipe, build the tokenizer and warm it; answer ``ready`` (or ``failed``, then
    None)."""
    hold_heap(CHILD_KEEP_MB)
    try:
        recipe, warm_chars = inbox.recv()
        encoder: Encoder = recipe()
        encoder.count_many([_WARM_TEXT, _WARM_TEXT * 64])
        started = time.perf_counter()
        if warm_chars > 0:
            encoder.count_many([warm_text(warm_chars)])
        warm_ms = (time.perf_counter() - started) * 1000
        trim_heap()  # what the load and the warm-up freed: the memory bound watches RSS
    # pyo3's PanicException derives from BaseException; the parent raises what it is told.
    except BaseException as exc:  # noqa: BLE001 - sent to the parent, which raises it
        outbox.send(("failed", f"{type(exc).__name__}: {str(exc)[:500]}", _rss_mb()))
        return None
    outbox.send(("ready", warm_ms, _rss_mb()))
    return encoder


def _answer_calls(encoder: Encoder, inbox: Connection, outbox: Connection) -> None:
    while True:
        try:
            op, arg = inbox.recv()
        except (EOFError, OSError):
            return
        try:
            result = _answer(encoder, op, arg)
        except BaseException as exc:  # noqa: BLE001 - sent to the parent, which raises it
            if op == "decode" and isinstance(exc, ValueError):
                # An id outside the vocabulary: the caller's input, raised there as ValueError.
                outbox.send(("invalid", str(exc)[:500], _rss_mb()))
            else:
                outbox.send(("failed", f"{type(exc).__name__}: {str(exc)[:500]}", _rss_mb()))
            continue
        outbox.send(("ok", result, _rss_mb()))


def _reap(_signum: int, _frame: object) -> None:
    """Wait for every child that ended, so none stays a zombie (the gateway sees it gone) and
    its CPU time is added to the template's (what a benchmark reads)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _serve_template(inbox: Connection, outbox: Connection, control: socket.socket) -> None:
    """The template: load, then fork a counting child for each pair of pipe ends the gateway
    sends, until it closes the control socket."""
    encoder = _load(inbox, outbox)
    if encoder is None:
        return
    signal.signal(signal.SIGCHLD, _reap)
    while True:
        try:
            child_reads, child_writes = recvfds(control, 2)
        except (EOFError, OSError, RuntimeError):  # closed (the gateway is done or gone)
            return
        pid = os.fork()
        if pid == 0:  # the counting child: only its own two pipe ends
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            no_huge_pages()  # the cache table's doublings: lifetime.no_huge_pages
            control.close()
            inbox.close()
            outbox.close()
            try:
                _answer_calls(
                    encoder,
                    Connection(child_reads, writable=False),
                    Connection(child_writes, readable=False),
                )
            finally:
                os._exit(0)
        os.close(child_reads)
        os.close(child_writes)
        outbox.send(("forked", pid))


def warm_text(chars: int) -> str:
    """A mixed text (prose, CJK, emoji, JSON) of ``chars`` characters."""
    return (_WARM_TEXT * (chars // len(_WARM_TEXT) + 1))[:chars]


def gigatoken_from_json(data: bytes) -> GigatokenEncoder:
    """A recipe: gigatoken from tokenizer.json bytes (gigatoken applies its normaliser)."""
    import gigatoken as gt

    # .backend drops the wrapper, which would keep the 13 MB JSON text alive for as_hf().
    return GigatokenEncoder(gt.Tokenizer.from_json(data).backend, nfc=False)


def gigatoken_from_tiktoken(
    path: str, pretokenizer: str, specials: dict[str, int], nfc: bool
) -> GigatokenEncoder:
    """A recipe: gigatoken from a .tiktoken file (``nfc``: normalise here, which a .tiktoken
    file cannot say)."""
    import gigatoken as gt

    tokenizer = gt.Tokenizer.from_tiktoken(path, pretokenizer=pretokenizer, special_tokens=specials)
    return GigatokenEncoder(tokenizer.backend, nfc=nfc)


if __name__ == "__main__":
    _serve_template(
        Connection(int(sys.argv[1]), writable=False),
        Connection(int(sys.argv[2]), readable=False),
        socket.socket(fileno=int(sys.argv[3])),
    )
