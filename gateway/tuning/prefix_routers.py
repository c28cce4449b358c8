"""The prefix routers a replay can compare: each endpoint order, over the endpoints' views.

Prefix caching (``FleetSim(..., prefix=PrefixSim(router))``, gateway/tuning/fleet_sim.py): each
engine holds a prefix cache, a block LRU of its profile's KV size
(``engine_pool/sim/prefix_cache.py``); a trace record naming a ``prefix`` of ``prefix_tokens``
shares that many leading tokens with the others naming it, and the scheduler skips the prefill
of the blocks its engine holds when it admits it. The router picks the endpoint order:

- ``least-loaded``: the picker's order (fewest in flight), what a lane without prefix weight does;
- ``affinity``: the previous picker (a rendezvous hash of the prefix name puts its home first)
  followed by the previous admission's re-sort by in-flight count (a stable sort: home first
  only on a tie);
- ``chain``: the live chain (engine_pool/chain.py) with the lane's ``weights`` and
  ``prefix_hold_tokens``, the gateway's approximate index (engine_pool/prefix_index.py) fed by
  where it sent each prefix and bounded per endpoint by the KV capacity the engine reports
  (``capacity_read``: the simulated engine's ``vllm:cache_config_info``, parsed as the live
  monitor parses it, carried on the endpoints' views), and its prefill ledger (the uncached
  tokens it believed it sent each endpoint, until their first token); it sees its lane's full
  endpoints, as the live chain does, and the store takes the first with room;
- ``cache-aware``: SGLang Model Gateway's ``cache_aware`` policy with its defaults, on the same
  approximate record: when the loads are imbalanced (max - min > 64 and max > 1.5 x min) the
  least loaded; else the endpoint with the longest match if it covers more than 30% of the
  prompt, else the one whose record holds the fewest blocks;
- ``oracle``: the chain, told each engine's real cache instead of the index (FleetSim says
  which blocks each endpoint holds; the order is ``by_chain``'s).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from prometheus_client import generate_latest

from engine_pool import chain
from engine_pool.capability import parse_cache_config
from engine_pool.cluster import EngineView
from engine_pool.picker import order_endpoints
from engine_pool.prefix_index import PrefixIndex
from engine_pool.sim.metrics import SimMetrics
from engine_pool.sim.profile import EngineProfile
from gateway.settings import LaneSettings, PrefixIndexSettings

Router = Literal["least-loaded", "affinity", "chain", "cache-aware", "oracle"]
ROUTERS: tuple[Router, ...] = ("least-loaded", "affinity", "cache-aware", "chain", "oracle")
# SGLang Model Gateway's cache_aware defaults (--cache-threshold, --balance-abs-threshold,
# --balance-rel-threshold).
SMG_CACHE_THRESHOLD, SMG_BALANCE_ABS, SMG_BALANCE_REL = 0.3, 64, 1.5


def _rendezvous(prefix: str, url: str) -> bytes:
    """The previous picker's rendezvous weight of an endpoint for a prefix (deterministic)."""
    return hashlib.blake2b(f"{prefix}|{url}".encode(), digest_size=8).digest()


@dataclass(frozen=True, slots=True)
class PrefixSim:
    """Model each engine's prefix cache and route by ``router`` (see the module's docstring)."""

    router: Router = "chain"


def approximate_index(settings: PrefixIndexSettings, clock: Callable[[], float]) -> PrefixIndex:
    """The gateway's approximate index as gateway/request/prefix.py builds it, on ``clock``."""
    return PrefixIndex(
        settings.max_blocks,
        settings.ttl_s,
        clock,
        block_tokens=settings.block_tokens,
        backstop_ttl_s=settings.backstop_ttl_s,
    )


def capacity_read(profile: EngineProfile, kind: str) -> int | None:
    """The KV capacity the gateway reads from a simulated engine of ``profile``: its
    ``vllm:cache_config_info`` as the sim server exports it, parsed as the live monitor parses
    a vLLM engine's (an SGLang engine exports none: unknown)."""
    if kind != "vllm":
        return None
    metrics = SimMetrics(profile.model, kv_capacity_tokens=profile.scheduler.kv_capacity_tokens)
    return parse_cache_config(generate_latest(metrics.registry).decode())


def by_affinity(views: list[EngineView], prefix: str, every: Sequence[str]) -> list[EngineView]:
    """``affinity``: the prefix's rendezvous home among ``every`` endpoint URL first, then
    re-sorted by in-flight count."""
    home = max(every, key=lambda url: _rendezvous(prefix, url))
    ordered = sorted(views, key=lambda v: (v.url != home, v.in_flight))
    return sorted(ordered, key=lambda v: v.in_flight)


def cache_aware(
    views: list[EngineView], blocks: Sequence[int], index: PrefixIndex
) -> list[EngineView]:
    """``cache-aware``: SGLang Model Gateway's choice first, the rest least loaded."""
    least = order_endpoints(views)
    loads = [v.in_flight for v in views]
    if max(loads) - min(loads) > SMG_BALANCE_ABS and max(loads) > SMG_BALANCE_REL * min(loads):
        return least
    held = index.match(blocks)
    best = max(least, key=lambda v: held.get(v.url, 0))
    if held.get(best.url, 0) / len(blocks) > SMG_CACHE_THRESHOLD:
        choice = best
    else:
        choice = min(least, key=lambda v: index.held_by(v.url))
    return [choice, *(v for v in least if v is not choice)]


def by_chain(
    views: list[EngineView],
    lane: LaneSettings,
    prompt_tokens: int,
    held: Mapping[str, int],
    block_tokens: int,
    index: PrefixIndex,
    pending: Mapping[str, int],
) -> list[EngineView]:
    """``chain`` and ``oracle``: the live chain's order, ``held`` the blocks of the prompt each
    endpoint is believed to hold (the index's, or the engines' real caches')."""
    ask = chain.Ask(
        tokens=prompt_tokens,
        cached={url: n * block_tokens for url, n in held.items()},
        limit_of=lambda v: lane.slots.per_endpoint,
        held={v.url: index.held_by(v.url) for v in views},
        pending=pending,
    )
    ranked = chain.rank(
        views, ask, lane.weights.as_map(), lane.prefix_hold_tokens, lane.new_home_slack
    )
    return [r.view for r in ranked]
