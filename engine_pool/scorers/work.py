"""Scorer: how little prefill stands before the request's first token on the endpoint, 0 to 1.

An endpoint's work for the request (``Ask.work``) is the prompt tokens it still has to prefill
for the requests the gateway sent it (``Ask.pending``, engine_pool/prefill_ledger.py) plus this
request's own uncached part (its prompt less the prefix the endpoint is believed to hold). The
score is (least work among the candidates + ``FLOOR_TOKENS``) over (the endpoint's work +
``FLOOR_TOKENS``): 1 for the least, lower as the prefill ahead grows past it, so a home busy
with cached follow-ups can score above an idle endpoint that must prefill the whole prompt.
The floor keeps a few hundred tokens from counting as a difference: a prefill within one
engine step's token budget (vLLM's ``max_num_batched_tokens``, 8192 by default) costs about
one step whatever its size."""

from __future__ import annotations

from collections.abc import Sequence

from engine_pool.cluster import EngineView
from engine_pool.scorers.ask import Ask

FLOOR_TOKENS = 8192


def score(views: Sequence[EngineView], ask: Ask) -> list[float]:
    work = [ask.work(v) + FLOOR_TOKENS for v in views]
    least = min(work, default=FLOOR_TOKENS)
    return [least / w for w in work]
