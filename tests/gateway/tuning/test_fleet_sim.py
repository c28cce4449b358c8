"""The fleet simulator's prefix caches and routers (``FleetSim(..., prefix=PrefixSim(router))``)."""

from __future__ import annotations

from gateway.observe.trace import TraceRecord, synthesize
from gateway.tools.bench.prefix import policy
from gateway.tuning.fleet_sim import FleetSim, PrefixSim, Router
from gateway.tuning.replay import cluster_profiles

ROUTERS_COMPARED: tuple[Router, ...] = ("least-loaded", "chain", "oracle")


def hit_rate(router: Router | None, trace: list[TraceRecord]) -> float:
    settings = policy()
    sim = FleetSim(
        settings, cluster_profiles(settings), prefix=None if router is None else PrefixSim(router)
    )
    outcomes = [o for o in sim.run(trace).outcomes if o.finished is not None]
    assert len(outcomes) == len(trace)
    return sum(o.cached_tokens for o in outcomes) / sum(o.prompt_tokens for o in outcomes)


def test_the_shared_prefix_trace_names_each_prefix_and_its_length() -> None:
    trace = synthesize("shared-prefix", 1)
    agents = {r.prefix for r in trace if r.prefix and r.prefix.startswith("agent-")}
    docs = [r for r in trace if r.prefix and r.prefix.startswith("doc-")]
    assert len(agents) == 160 and len(docs) == 60
    assert all(r.prefix_tokens is not None and r.prefix_tokens < r.prompt_tokens for r in trace)
    assert synthesize("shared-prefix", 1) == trace


def test_without_prefix_caches_nothing_is_cached() -> None:
    trace = [r for r in synthesize("shared-prefix", 1) if r.t < 60]
    assert hit_rate(None, trace) == 0.0


def test_routing_by_prefix_finds_more_of_it_cached_than_least_loaded() -> None:
    trace = [r for r in synthesize("shared-prefix", 1) if r.t < 180 and r.prompt_tokens < 32768]
    least, chain, oracle = (hit_rate(r, trace) for r in ROUTERS_COMPARED)
    assert least < chain
    assert abs(oracle - chain) < 0.05
