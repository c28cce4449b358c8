"""What a request brings to admission besides its lane (step 5's ``Want``): its priority
class, from its API key and lowered by its header (gateway/request/classes.py), and the loans
open to it, the lending lanes' routable endpoints for a short request routed by its count
(gateway/request/borrowing.py). The pipeline (gateway/request/pipeline.py) asks ``want_of``
once the lane is decided.
"""

from __future__ import annotations

from engine_pool.cluster import EngineView
from engine_pool.picker import order_endpoints
from engine_pool.registry import EnginePool
from gateway.core.exchange import header
from gateway.errors import BadRequest
from gateway.request.borrowing import Loan, loans_for
from gateway.request.classes import UnknownClass, bearer_digest, class_of
from gateway.request.context import RequestContext
from gateway.request.slot import Want


def want_of(ctx: RequestContext, pool: EnginePool) -> Want:
    """The request's priority class (API key, lowered by its header) and the loans open to
    it: lending lanes' routable endpoints, for a short request routed by its count."""
    policy, decision = ctx.policy, ctx.decision
    classes = policy.settings.classes
    asked = header(ctx.scope, classes.header.encode())
    try:
        priority = class_of(
            classes,
            bearer_digest(header(ctx.scope, b"authorization")),
            asked.decode("latin-1") if asked is not None else None,
        )
    except UnknownClass as exc:
        raise BadRequest(str(exc), param=classes.header) from None
    lane = decision.lane
    if lane is None or decision.reason != "in_range":
        return Want(priority, classes)
    loans = loans_for(lane, policy.settings.lanes, ctx.count.tokens, ctx.request.max_tokens)
    model = ctx.model.name

    def lent() -> list[tuple[EngineView, Loan]]:
        return [
            (view, loan)
            for loan in loans
            for cluster in loan.clusters
            if policy.serves(cluster, model)
            for view in order_endpoints(pool.views(cluster))
        ]

    return Want(priority, classes, loans, lent)
