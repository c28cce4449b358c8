"""Pause a long read for a cached question on the same engine. Pure.

    to_pause(question, in_flight, rule) -> list[str]     the keys of the requests to pause

A follow-up question on a document its engine holds (a 250k-token prompt with at most a few
thousand tokens uncached) needs a second of prefill; sent while the same engine reads another
document (a prefill of minutes, run chunk by chunk ahead of every waiting request, as vLLM's
scheduler runs its running requests first), it waits for the whole read. Sending it elsewhere
re-reads its own document, which takes as long. Pausing the read costs it only the question's
few seconds: an engine frees an aborted request's computed blocks into its prefix cache, hashes
kept (vLLM 0.32: tests/real/test_long_prefill.py), so the read sent again finds what it had
computed and loses at most the step it was stopped in.

A request is paused when a question (``Question.uncached`` at most ``question_max_tokens``) is
sent to its endpoint and it

- had more than ``read_min_tokens`` of its prompt to prefill there when it was sent
  (``remaining``: its prompt less the prefix the endpoint was believed to hold, the prefill
  ledger's entry, engine_pool/prefill_ledger.py; a read nearly done is paused too, and loses
  only the step it was in);
- has no first token yet (nothing reached its client: it sees only a delay);
- does not share the question's first block (a read of the question's own document is what the
  question waits for);
- is not itself a question that paused others and has not finished;
- has been paused fewer than ``max_pauses`` times (a stream of questions cannot starve it).

A request with no first token yet sharing its first block with a request paused is paused with
it, under the same limits: it was sent believing the read's blocks cached (so its own entry is
small), and left to run it would read the rest of the document itself, ahead of the question.
Without this the rule gains nothing in ``shapegate bench prefix``: it pauses the read, and the
read's burst partner queued behind it takes its place.

The pipeline (gateway/request/pipeline.py) closes a paused request's connection (the engine
aborts it), keeps its slot, and sends it again to the same endpoint once no question that
paused requests there is in flight; the what-if replay (gateway/tuning/fleet_sim.py) plays the
same rule on its simulated engines.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class PauseRule(NamedTuple):
    """``lanes[].pause_reads`` (gateway/settings.py ``PauseSettings``)."""

    question_max_tokens: int = 8192
    read_min_tokens: int = 32768
    max_pauses: int = 3


class Question(NamedTuple):
    """The request just sent: its uncached prompt tokens there and its first block's digest
    (None: its prompt is shorter than a block)."""

    uncached: int
    head: int | None


class InFlight(NamedTuple):
    """A request in flight on the question's endpoint."""

    key: str
    remaining: int
    head: int | None
    started: bool
    pauses: int
    pausing: bool


def is_question(question: Question, rule: PauseRule) -> bool:
    """The request needs so little prefill that a read ahead of it is worth pausing."""
    return question.uncached <= rule.question_max_tokens


def to_pause(question: Question, in_flight: Sequence[InFlight], rule: PauseRule) -> list[str]:
    """The keys of the requests on the question's endpoint to pause (module docstring)."""
    if not is_question(question, rule):
        return []

    def may(r: InFlight) -> bool:
        own = question.head is not None and r.head == question.head
        return not (r.started or r.pausing or own or r.pauses >= rule.max_pauses)

    reads = [r for r in in_flight if may(r) and r.remaining > rule.read_min_tokens]
    heads = {r.head for r in reads if r.head is not None}
    chosen = {r.key for r in reads}
    waiting_on = [r for r in in_flight if r.key not in chosen and r.head in heads and may(r)]
    return [r.key for r in (*reads, *waiting_on)]
