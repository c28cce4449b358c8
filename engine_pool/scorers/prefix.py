"""Scorer: the share of the prompt the endpoint is believed to hold cached (its longest cached
prefix in tokens, from engine_pool/prefix_index.py, over the prompt's tokens), 0 to 1."""

from __future__ import annotations

from collections.abc import Sequence

from engine_pool.cluster import EngineView
from engine_pool.scorers.ask import Ask


def score(views: Sequence[EngineView], ask: Ask) -> list[float]:
    if ask.tokens <= 0 or not ask.cached:
        return [0.0] * len(views)
    return [min(1.0, ask.cached.get(v.url, 0) / ask.tokens) for v in views]
