"""Scorer: the share of the endpoint's slots still free, 1 idle to 0 full.

Used share = the gateway's in-flight requests on the endpoint / its slot limit for the lane,
capped at 1 (the engine's own waiting queue breaks ties in the chain's order). Without a limit
(``Ask.limit_of`` None) the largest in-flight count among the candidates plus one stands in, so
the order is still least loaded first."""

from __future__ import annotations

from collections.abc import Sequence

from engine_pool.cluster import EngineView
from engine_pool.scorers.ask import Ask


def score(views: Sequence[EngineView], ask: Ask) -> list[float]:
    limit_of = ask.limit_of
    if limit_of is None:  # the largest in-flight count plus one, for every endpoint
        fallback = max([v.in_flight for v in views], default=0) + 1
        return [1.0 - min(1.0, v.in_flight / max(1, fallback)) for v in views]
    return [1.0 - min(1.0, v.in_flight / max(1, limit_of(v))) for v in views]
