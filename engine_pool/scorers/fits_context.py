"""Filter: only endpoints whose own context holds the prompt plus its output room
(engine_pool/capability.py ``holds``; an unknown context holds anything)."""

from __future__ import annotations

from engine_pool.capability import holds
from engine_pool.cluster import EngineView
from engine_pool.scorers.ask import Ask


def keep(view: EngineView, ask: Ask) -> bool:
    return ask.need <= 0 or holds(view, ask.need)
