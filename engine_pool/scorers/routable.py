"""Filter: only endpoints whose health state takes traffic (up or slow, never down)."""

from __future__ import annotations

from engine_pool.cluster import EngineView
from engine_pool.scorers.ask import Ask


def keep(view: EngineView, ask: Ask) -> bool:
    return view.state.routable
