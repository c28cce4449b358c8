"""What the chain knows of a request (engine_pool/chain.py), as every filter and scorer reads it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from engine_pool.cluster import EngineView


@dataclass(frozen=True, slots=True)
class Ask:
    """What the chain knows of the request: its prompt plus the output room it needs (tokens;
    0 skips the context filter), the prefix tokens each endpoint (by URL) is believed to hold,
    and each endpoint's slot limit (None: the largest in-flight count among them, plus one)."""

    tokens: int = 0
    need: int = 0
    cached: Mapping[str, int] = field(default_factory=dict)
    # Blocks the prefix index holds per endpoint URL: on a tie, the one holding least is the
    # new home of a prefix (homes spread by what they hold, not by the URL).
    held: Mapping[str, int] = field(default_factory=dict)
    limit_of: Callable[[EngineView], int] | None = None
