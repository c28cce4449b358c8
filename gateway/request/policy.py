"""Policy: what a request is admitted under, the unit a reload swaps (gateway/edge/reload.py).

The settings, the tokenizers, the engine keys and client auth, and what every request would
otherwise compute again from them (the count threshold, each endpoint's slot limit per lane,
the forwarded headers, the models each cluster serves).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine_pool.cluster import EngineView
from gateway.count.tokens import TokenCounter
from gateway.lifetime import InUse
from gateway.request.auth import ClientAuth
from gateway.request.lanes import endpoint_limit, exact_count_above
from gateway.settings import LaneSettings, Settings, served_models


@dataclass(frozen=True, slots=True)
class Policy:
    """What a request is admitted under: settings, tokenizers and engine keys, swapped whole on
    reload. A request reads the policy once, so it finishes under the one that admitted it."""

    settings: Settings
    counter: TokenCounter
    engine_keys: dict[str, str]
    auth: ClientAuth
    version: int = 1
    # The requests running under this policy: a reload closes a replaced counter after them.
    in_use: InUse = field(default_factory=InUse, compare=False)
    exact_above: int = field(init=False)
    # (lane, cluster) -> the slot limit of one of the cluster's endpoints for that lane.
    endpoint_limits: dict[tuple[str, str], int] = field(init=False)
    forward_headers: frozenset[str] = field(init=False)
    # cluster -> the models it serves by their policy names (aliases in clusters[].models
    # resolved: requests are matched by the model's own name).
    served: dict[str, frozenset[str]] = field(init=False)

    def __post_init__(self) -> None:
        lanes = self.settings.lanes
        # A bound decides the lane alone, but a loan needs a count under its budget: past the
        # smallest budget, count exactly (gateway/request/borrowing.py).
        budgets = [lane.lend.max_prompt_tokens for lane in lanes if lane.lend is not None]
        object.__setattr__(self, "exact_above", min([exact_count_above(lanes), *budgets]))
        limits = {
            (lane.name, c.name): endpoint_limit(lanes, lane, c.name)
            for lane in lanes
            for c in self.settings.clusters
        }
        object.__setattr__(self, "endpoint_limits", limits)
        extra = frozenset(name.lower() for name in self.settings.routes.forward_headers)
        object.__setattr__(self, "forward_headers", extra)
        served = {
            c.name: frozenset(served_models(self.settings, c.name)) for c in self.settings.clusters
        }
        object.__setattr__(self, "served", served)

    def serves(self, cluster: str, model: str) -> bool:
        """Whether ``cluster`` serves ``model`` (the policy's name of the model)."""
        return model in self.served[cluster]

    def limit_of(self, lane: LaneSettings) -> Callable[[EngineView], int]:
        """The slot limit of an endpoint for this lane's requests (gateway/request/lanes.py)."""
        limits, name = self.endpoint_limits, lane.name
        return lambda view: limits[(name, view.cluster)]
