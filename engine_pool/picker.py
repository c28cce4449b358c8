"""Endpoint choice inside a cluster: a pure function of a snapshot.

    order_endpoints(views, affinity=None) -> list[EngineView]

Routable endpoints only, least loaded first: fewest gateway in-flight requests, then fewest
requests waiting in the engine's own queue, then URL for a stable tie-break. With an affinity key
(a hash of a shared prompt prefix) the endpoint chosen by rendezvous hashing goes first, so every
replica sends agents that reuse a long prefix to the engine that has it cached; the others follow
as fallbacks when it has no free slot. The slot store takes the first candidate with room.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from engine_pool.cluster import EngineView


def _rendezvous(affinity: bytes, url: str) -> bytes:
    return hashlib.blake2b(affinity + b"|" + url.encode(), digest_size=8).digest()


def order_endpoints(views: Sequence[EngineView], affinity: bytes | None = None) -> list[EngineView]:
    routable = [v for v in views if v.state.routable]
    ordered = sorted(routable, key=lambda v: (v.in_flight, v.waiting or 0.0, v.url))
    if affinity is None or not ordered:
        return ordered
    home = max(ordered, key=lambda v: _rendezvous(affinity, v.url))
    return [home, *(v for v in ordered if v is not home)]
