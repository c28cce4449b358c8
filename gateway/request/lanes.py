"""The lane decision: a pure function of the token count, the policy and a health snapshot.

    lane_tokens(total, largest, lanes) -> int             (the figure that picks the lane)
    choose_lane(prompt_tokens, lanes, healthy) -> Decision
    choose_named_lane(name, lanes, healthy) -> Decision   (routes with no text to count)
    pin_to_cluster(decision, cluster, lanes) -> Decision  (stateful Responses follow-ups)

- The figure is ``lane_tokens``: the prompt tokens the engine prefills (a batch's total: vLLM
  admits every prompt of a batched completions or embeddings request at once, so the batch is
  that much prefill work in front of the lane's other requests), but context fit is per
  prompt: a batch whose every prompt fits the top lane is not refused for its total, it goes to
  the top lane. Only a single prompt above every range is ``no_lane``.
- The lane is the one whose ``[min_prompt_tokens, max_prompt_tokens)`` range holds the figure.
  Lanes never overlap (settings validate it), so order only matters for reading.
- Its primary clusters are used while at least one of them is healthy. Only when every primary
  is down are the emergency clusters used (reason ``primary_unhealthy``). A busy primary is never
  a reason to spill: busy is the slot queue's business, not routing's.
- A count outside every range is ``no_lane``; no healthy cluster at all is
  ``no_healthy_cluster``. The pipeline turns those into 400 and 503.

``endpoint_limit(lanes, lane, cluster)`` is how many requests one endpoint of ``cluster`` may
hold in flight when ``lane`` sends one there: its own ``per_endpoint`` on its own clusters; on an
emergency cluster, the engine's own limit (the ``per_endpoint`` of the lanes whose primary it
is), never the visiting lane's. The endpoint count is shared by every lane, so the engine never
holds more than its limit; the visiting lane stays bounded by its own ``slots.lane``.

``exact_count_above(lanes)`` is the token count below which the free upper bound alone decides
the lane: a bound under the first lane's ceiling proves the prompt belongs to that lane.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gateway.core.decision import Decision
from gateway.settings import LaneSettings


def lane_tokens(total: int, largest: int, lanes: Sequence[LaneSettings]) -> int:
    """The figure that picks the lane: ``total`` (the prefill work), held below the top lane's
    ceiling when the ``largest`` single prompt fits under it (a batch is never refused for a
    total its prompts do not need as one context)."""
    # Plain loop and comparisons, not max() over a comprehension: 0.16 against 0.41 us, and it
    # runs twice a request with a shadow policy.
    top = 0
    for lane in lanes:
        if lane.max_prompt_tokens > top:  # noqa: PLR1730 - max() here is a call per lane
            top = lane.max_prompt_tokens
    if largest >= top:
        return total
    return total if total < top else top - 1


def lane_for(prompt_tokens: int, lanes: Sequence[LaneSettings]) -> LaneSettings | None:
    for lane in lanes:
        if lane.min_prompt_tokens <= prompt_tokens < lane.max_prompt_tokens:
            return lane
    return None


def choose_lane(
    prompt_tokens: int, lanes: Sequence[LaneSettings], healthy: Mapping[str, bool]
) -> Decision:
    """Pick the lane for a prompt and the clusters that may serve it.

    ``healthy`` maps cluster name to whether at least one of its endpoints is routable; a
    cluster missing from it counts as healthy (no evidence against it yet).
    """
    lane = lane_for(prompt_tokens, lanes)
    if lane is None:
        return Decision(lane=None, clusters=(), reason="no_lane")
    return _serving(lane, healthy)


def choose_named_lane(
    name: str, lanes: Sequence[LaneSettings], healthy: Mapping[str, bool]
) -> Decision:
    """The lane a policy names for requests with no text to count (multipart audio routes)."""
    for lane in lanes:
        if lane.name == name:
            return _serving(lane, healthy)
    return Decision(lane=None, clusters=(), reason="no_lane")


def pin_to_cluster(decision: Decision, cluster: str, lanes: Sequence[LaneSettings]) -> Decision:
    """A stateful Responses follow-up: the lane holding the engine that stored the previous
    response (the counted lane if it holds it), that cluster only. Unchanged when no lane holds
    the cluster any more (a reload removed it) or the count fits no lane at all."""
    if decision.lane is None:
        return decision
    holding = [decision.lane, *lanes]
    for lane in holding:
        if cluster in lane.clusters or cluster in lane.emergency_clusters:
            return Decision(lane=lane, clusters=(cluster,), reason="response_affinity")
    return decision


def _serving(lane: LaneSettings, healthy: Mapping[str, bool]) -> Decision:
    clusters = lane.clusters
    # Every primary healthy (the usual case): the lane's own tuple, no copy filtered out of it.
    for c in clusters:
        if not healthy.get(c, True):
            break
    else:
        return Decision(lane, clusters, "in_range")
    primaries = tuple([c for c in clusters if healthy.get(c, True)])
    if primaries:
        return Decision(lane=lane, clusters=primaries, reason="in_range")
    emergencies = tuple(c for c in lane.emergency_clusters if healthy.get(c, True))
    if emergencies:
        return Decision(lane=lane, clusters=emergencies, reason="primary_unhealthy")
    return Decision(lane=lane, clusters=(), reason="no_healthy_cluster")


def no_lane_message(prompt_tokens: int, lanes: Sequence[LaneSettings]) -> str:
    """Why no lane takes this count, truthfully: above every range, or (a policy with a hole,
    which validation refuses) in no range."""
    top = max(lane.max_prompt_tokens for lane in lanes)
    if prompt_tokens >= top:
        return f"prompt of {prompt_tokens} tokens is above every lane's range (largest {top - 1})"
    ranges = ", ".join(
        f"{lane.min_prompt_tokens}-{lane.max_prompt_tokens - 1}"
        for lane in sorted(lanes, key=lambda lane: lane.min_prompt_tokens)
    )
    return f"no lane takes a prompt of {prompt_tokens} tokens (lanes take {ranges})"


def endpoint_limit(lanes: Sequence[LaneSettings], lane: LaneSettings, cluster: str) -> int:
    """The slot limit of one endpoint of ``cluster`` for a request of ``lane``."""
    if cluster in lane.clusters:
        return lane.slots.per_endpoint
    owners = [other.slots.per_endpoint for other in lanes if cluster in other.clusters]
    return max(owners) if owners else lane.slots.per_endpoint


def exact_count_above(lanes: Sequence[LaneSettings]) -> int:
    """Counts (or bounds) below this need no tokenizer: they can only land in the lowest lane."""
    lowest = min(lanes, key=lambda lane: lane.min_prompt_tokens)
    return lowest.max_prompt_tokens if lowest.min_prompt_tokens == 0 else 0
