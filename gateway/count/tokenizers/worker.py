"""A tokenizer in a child process, replaced when its memory passes a bound.

Why, for gigatoken 0.10.0 (the official package) keeps every distinct pre-token it has encoded in a
cache inside the tokenizer, with no bound and no way to clear it; text made of ever-new pieces
(random CJK, base64) grows it by 3-6 MB per MB of text. Loading a fresh tokenizer in the
gateway's own process would hold the GIL for ~1.3 s (the event loop stalls), and the allocator
keeps part of what the old one freed. A child process gives both back: it loads off the
gateway's GIL, and its memory returns to the system when it exits. The tokenizer is loaded once,
in the template: a fresh interpreter running child.py, not a fork of the gateway (nothing of the
gateway is copied or re-imported into it), which never counts. Each counting child is an
``os.fork`` of the template, so a replacement costs a fork, not a load (processes.py: how the
template and its children are started, forked, rehearsed and stopped). tiktoken runs here too
when it stands in for gigatoken on a tokenizer.json (``byte_level.py``): building its ranks
parses the whole vocabulary (0.7 s, ~100 MB), which the gateway's loop never pays.

Contract of ``ChildEncoder`` (an ``Encoder`` with the backend of its recipe):
- ``encode``, ``decode``, ``count_many``, ``try_count_many`` answer exactly what the same
  encoder answers in-process (the child runs what the recipe builds; ``decode``'s
  ``ValueError`` for an id outside the vocabulary is raised here as the same); calls are
  serialised by ``lock``, the calling thread waits on a pipe without holding the GIL.
- Each answer carries the child's resident memory. Past ``max_rss_mb`` (at least
  ``READY_HEADROOM`` x what the child held once loaded, or it would be replaced on every call)
  a replacement is forked from the template in the background and rehearsed while the old
  child keeps answering, and takes over at the first call after it is ready; the old child is
  then stopped. A count never waits for a replacement: for that time the tokenizer holds two
  children, the old one (past the bound by what it grew meanwhile) and the fresh one (what a
  loaded, warmed child holds). A replacement that fails is logged as swallowed and the old
  child keeps serving; the next call past the bound starts another. A template that is gone
  is started again first (a full load, the only one after boot).
- A child that died (killed, crashed) is replaced before the call is retried once; a failure
  raised inside the child is raised here as ``EncoderFailed``.
- The template encodes ``warm_chars`` characters before it answers ready
  (``tokenizers/warmup.py``); every counting child, the first and each replacement, then counts
  one text as large sent through the pipe as requests' are (``processes._rehearse``: the
  pickle, both pipe ends, the child's heap grown to a monster's size and held there,
  ``hold_heap``), all before it takes any request's count: the first monster after a recycle
  is as fast as the tenth. Both are logged by processes.py (``tokenizer.template_ready``,
  ``tokenizer.child_warmed`` with the fork's and the pipe round trip's ms).
- ``close()`` stops the child; so does garbage collection of the encoder, and the child exits
  by itself when the gateway's end of the pipe closes (the gateway died).
Events: ``tokenizer.recycle_started`` (rss_mb), ``tokenizer.recycled`` (old_rss_mb, calls, load_s),
``tokenizer.child_lost`` (via ``swallowed``).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from gateway.count.tokenizers.encoders import Backend, Encoder
from gateway.count.tokenizers.processes import (
    Child,
    EncoderFailed,
    fork,
    start_template,
    stop_all,
    stop_child,
)
from gateway.observe.log import get_logger, swallowed

if TYPE_CHECKING:
    from gateway.observe.metrics import Metrics

# The bound is at least this much above what a freshly loaded child holds.
READY_HEADROOM = 1.25


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
        self._template = start_template(recipe, warm_chars)
        try:
            self._child = fork(self._template, warm_chars)
        except EncoderFailed:
            stop_child(self._template)
            raise
        self._next: Child | None = None
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
            stop_all([c for c in (self._child, self._next, self._template) if c is not None])

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

    def _spawn(self) -> Child:
        """A counting child forked from the template; a template that is gone (killed, crashed)
        is started again first (a full load, the only one after boot)."""
        with self._spawning:
            try:
                return fork(self._template, self.warm_chars)
            except EncoderFailed as exc:
                if self._template.process.poll() is None:
                    raise  # the template lives: the fork or the child failed
                swallowed(
                    self._log, self._metrics, "tokenizer.template", exc, "restarted_the_template"
                )
                old, self._template = self._template, start_template(self._recipe, self.warm_chars)
                stop_child(old)
                self._stopped.detach()
                self._stopped = self._arm()
                return fork(self._template, self.warm_chars)

    def _arm(self) -> weakref.finalize[Any, Any]:
        """Stop the counting child and the template when this encoder is collected."""
        return weakref.finalize(self, stop_all, [self._child, self._template])

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
        threading.Thread(target=stop_child, args=(old,), name="tokenizer-stop", daemon=True).start()

    def _replace_now(self) -> None:
        old = self._child
        self._child = self._spawn()
        self._stopped.detach()
        self._stopped = self._arm()
        stop_child(old)
