"""Endpoint choice inside a cluster without a request in view: least loaded first.

    order_endpoints(views) -> list[EngineView]

Routable endpoints only, least loaded first: fewest gateway in-flight requests, then fewest
requests waiting in the engine's own queue, then URL for a stable tie-break. It is the chain
(engine_pool/chain.py) with the load scorer alone; the request path ranks with the lane's
weights (load and prefix overlap) through ``chain.rank`` itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine_pool.chain import Ask, rank
from engine_pool.cluster import EngineView

_NO_REQUEST = Ask()


def order_endpoints(views: Sequence[EngineView]) -> list[EngineView]:
    return [r.view for r in rank(views, _NO_REQUEST)]
