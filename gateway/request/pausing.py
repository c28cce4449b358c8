"""The requests in flight on each endpoint as the pause rule sees them (``lanes[].pause_reads``).

    pauses = Pauses(log, metrics)
    sent = pauses.sent(key, request_id, lane, url, remaining, head)
                                    the request goes to ``url`` with ``remaining`` prompt tokens
                                    to prefill there (a request sent again moves)
    pauses.ask(sent, rule)          it was sent: if it is a cached question, pause the reads the
                                    rule names on its endpoint (engine_pool/pause.py), logged
                                    ``route.paused`` and counted
    with pauses.attempt(sent, loop) as attempt:    one try at the engine, which a pause cancels
    await pauses.resumed(sent, watch)    a paused request waits until no question that paused
                                    requests on its endpoint is in flight (``DeadlineHit`` total
                                    when its total deadline comes first)
    pauses.left(sent)               it ended, whatever way: forgotten; the last pausing question
                                    of an endpoint to leave resumes the requests it paused

A request is paused by cancelling its attempt before its first byte reached the client (its
``started`` is set by the first chunk, before anything is relayed): the upstream connection is
closed, so the engine aborts it and keeps the blocks it computed in its prefix cache. Its slot
stays held; the pipeline sends it again, unchanged, to the same endpoint
(gateway/request/pipeline.py). Everything here is in-process and synchronous but the waits:
the decision and the cancellations happen in the question's task, with no await between them.
The registry's size is the requests in flight: every entry is removed when its request ends.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from engine_pool.pause import InFlight, PauseRule, Question, is_question, to_pause
from gateway.core.cancel import CancelScope
from gateway.core.watchdog import Watch
from gateway.observe.log import Logger
from gateway.observe.metrics import Metrics


@dataclass(eq=False, slots=True)
class Sent:
    """One request in flight on an endpoint."""

    key: str
    request_id: str
    lane: str
    url: str
    # Prompt tokens it had to prefill there when it was sent (the prefill ledger's entry).
    remaining: int
    # Its prompt's first block digest (None: shorter than a block, or not hashed).
    head: int | None
    # Its first chunk came back (or its whole answer): past pausing.
    started: bool = False
    pauses: int = 0
    # A question that paused requests on its endpoint (or came while some were paused there).
    pausing: bool = False
    # The attempt under way, None between attempts (and while paused).
    scope: CancelScope | None = None
    # Set when it may go on; None unless paused.
    resume: asyncio.Event | None = None
    paused_at: float = 0.0
    by: str = ""


class Pauses:
    def __init__(self, log: Logger, metrics: Metrics) -> None:
        self._log = log
        self._metrics = metrics
        # Endpoint URL -> key -> the request in flight there.
        self._on: dict[str, dict[str, Sent]] = {}
        # Endpoint URL -> the pausing questions in flight there.
        self._pausers: dict[str, set[str]] = {}
        # Endpoint URL -> the requests paused there, in the order they were paused.
        self._paused: dict[str, list[Sent]] = {}

    def __len__(self) -> int:
        return sum(len(on) for on in self._on.values())

    def paused(self, url: str) -> list[str]:
        """The keys of the requests paused on ``url``."""
        return [s.key for s in self._paused.get(url, ())]

    def sent(
        self,
        key: str,
        request_id: str,
        lane: str,
        url: str,
        remaining: int,
        head: int | None,
        previous: Sent | None = None,
    ) -> Sent:
        """The request goes to ``url``; ``previous``: its entry from an earlier endpoint (a
        failover or a migration), which it leaves."""
        if previous is not None:
            self.left(previous)
            sent = Sent(key, request_id, lane, url, remaining, head, previous.started)
            sent.pauses = previous.pauses
        else:
            sent = Sent(key, request_id, lane, url, remaining, head)
        self._on.setdefault(url, {})[key] = sent
        return sent

    def ask(self, sent: Sent, rule: PauseRule | None) -> list[str]:
        """``sent`` was just sent: pause what the rule names on its endpoint (engine_pool/
        pause.py); the keys paused."""
        if rule is None:
            return []
        url = sent.url
        question = Question(sent.remaining, sent.head)
        if not is_question(question, rule):  # a read: it pauses nothing and holds nothing
            return []
        others = [
            InFlight(s.key, s.remaining, s.head, s.started, s.pauses, s.pausing)
            for s in self._on.get(url, {}).values()
            if s is not sent and s.scope is not None
        ]
        keys = to_pause(question, others, rule)
        if keys or self._paused.get(url):
            sent.pausing = True
            self._pausers.setdefault(url, set()).add(sent.key)
        on = self._on[url]
        now = time.monotonic()
        for key in keys:
            victim = on[key]
            assert victim.scope is not None
            victim.pauses += 1
            victim.resume = asyncio.Event()
            victim.paused_at, victim.by = now, sent.request_id
            self._paused.setdefault(url, []).append(victim)
            victim.scope.cancel()  # at its next await: the connection closes, the engine aborts
            self._metrics.child(self._metrics.paused, victim.lane).inc()
            self._log.info(
                "route.paused",
                request_id=victim.request_id,
                lane=victim.lane,
                endpoint=url,
                by=sent.request_id,
                by_uncached_tokens=sent.remaining,
                remaining_tokens=victim.remaining,
                pauses=victim.pauses,
            )
        return keys

    def attempt(self, sent: Sent, loop: asyncio.AbstractEventLoop | None) -> _Attempt:
        """``with pauses.attempt(sent, loop) as attempt:`` one try that a pause cancels;
        ``attempt.paused`` after it: it was paused (nothing reached the client)."""
        return _Attempt(sent, loop)

    async def resumed(self, sent: Sent, watch: Watch) -> float:
        """Wait until the requests paused with ``sent`` may go on (no pausing question left in
        flight on its endpoint), bounded by its total deadline; the seconds it was paused."""
        resume = sent.resume
        assert resume is not None, "only a paused request waits"
        with watch.within("total"):
            await resume.wait()
        sent.resume = None
        waited = time.monotonic() - sent.paused_at
        self._log.info(
            "route.resumed",
            request_id=sent.request_id,
            lane=sent.lane,
            endpoint=sent.url,
            paused_s=round(waited, 3),
            pauses=sent.pauses,
        )
        return waited

    def left(self, sent: Sent) -> None:
        """``sent`` ended (or moved): forgotten; if it was the last pausing question on its
        endpoint, the requests paused there go on."""
        url = sent.url
        on = self._on.get(url)
        if on is None or on.get(sent.key) is not sent:
            return
        del on[sent.key]
        if not on:
            del self._on[url]
        paused = self._paused.get(url)
        if paused is not None and sent in paused:
            paused.remove(sent)
        pausers = self._pausers.get(url)
        if pausers is None or sent.key not in pausers:
            if paused is not None and not paused:
                del self._paused[url]
            return
        pausers.discard(sent.key)
        if pausers:
            return
        del self._pausers[url]
        for waiting in self._paused.pop(url, ()):
            assert waiting.resume is not None
            waiting.resume.set()


class _Attempt(CancelScope):
    """``Pauses.attempt``'s scope: the request's ``scope`` while entered (a pause cancels it)."""

    __slots__ = ("_sent",)

    def __init__(self, sent: Sent, loop: asyncio.AbstractEventLoop | None) -> None:
        super().__init__(loop=loop)
        self._sent = sent

    def __enter__(self) -> _Attempt:
        super().__enter__()
        self._sent.scope = self
        return self

    def __exit__(self, *exc: object) -> bool:
        self._sent.scope = None
        return super().__exit__(*exc)  # type: ignore[arg-type]

    @property
    def paused(self) -> bool:
        return self.cancelled_caught
