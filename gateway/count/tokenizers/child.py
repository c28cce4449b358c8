"""What runs in the tokenizer's child process (worker.py starts it, a fresh interpreter:
``python -m gateway.count.tokenizers.child READ_FD WRITE_FD``): read the recipe, build the
encoder, warm it, answer ``ready``, then answer calls until the gateway closes its end of the
pipe. Every answer carries the child's resident memory, which worker.py's bound watches.

The recipes (``gigatoken_from_json``, ``gigatoken_from_tiktoken``) are built in the gateway and
called here: picklable, and the 13 MB of a tokenizer.json never parsed in the gateway.

Wire, one pickled tuple each way: ``(recipe, warm_chars)`` then ``("ready", warm_ms, rss)`` or
``("failed", why, rss)``; then per call ``(op, arg)`` (``encode``, ``decode``, ``count``) and
``("ok", result, rss)``, ``("invalid", why, rss)`` (a ``decode`` of an id outside the
vocabulary) or ``("failed", why, rss)``.
"""

from __future__ import annotations

import os
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

from gateway.count.tokenizers.encoders import Encoder, GigatokenEncoder
from gateway.lifetime import hold_heap, trim_heap

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


def _serve(inbox: Connection, outbox: Connection) -> None:
    """The child: read its recipe, build the tokenizer, warm it, then answer calls until the
    gateway closes its end of the pipe (or dies)."""
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
        return
    outbox.send(("ready", warm_ms, _rss_mb()))
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
    _serve(
        Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False)
    )
