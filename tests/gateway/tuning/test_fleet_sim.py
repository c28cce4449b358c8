"""The fleet simulator's prefix caches and routers (``FleetSim(..., prefix=PrefixSim(router))``)."""

from __future__ import annotations

from gateway.observe.trace import TraceRecord, synthesize
from gateway.tools.bench.prefix import policy
from gateway.tuning.fleet_sim import FleetSim
from gateway.tuning.prefix_routers import PrefixSim, Router, capacity_read
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


def test_a_document_holding_for_its_full_home_does_not_hold_a_new_one_behind_it() -> None:
    """The bench's heavy lane (2 endpoints of 4 slots, ``prefix_hold_tokens: 0``): four
    questions on a 200k-token document fill its home; a fifth holds in the queue for that home
    rather than read the document again on the idle endpoint; a new document arriving behind
    it goes to the idle endpoint at once (it passes the holder, as the live admission lets it)
    instead of waiting behind it for the home to free."""

    def ask(t: float, doc: str, tokens: int) -> TraceRecord:
        return TraceRecord(
            t, "qwen3.6", tokens + 100, 4 * tokens, 100, True, None, doc, None, tokens
        )

    trace = [ask(i * 0.01, "doc-a", 200_000) for i in range(4)]
    trace += [ask(1.0, "doc-a", 200_000), ask(2.0, "doc-b", 150_000)]
    settings = policy()
    out = FleetSim(settings, cluster_profiles(settings), prefix=PrefixSim("chain")).run(trace)
    fifth, new = out.outcomes[4], out.outcomes[5]
    assert fifth.queue_wait is not None and fifth.queue_wait > 10
    assert fifth.cached_tokens >= 199_000  # waited for its home, not a second read
    assert new.queue_wait is not None and new.queue_wait < 0.1


def test_the_index_learns_each_engines_kv_capacity_and_keeps_what_it_still_holds() -> None:
    """The simulated engines export their KV cache as vLLM does (``vllm:cache_config_info``);
    the chain's index reads it as the live gateway does and bounds each endpoint's record by it
    instead of forgetting by the clock: a document asked again 20 minutes after its first read
    (past the 600 s TTL of an endpoint of unknown capacity), still in its home's cache, goes
    back to its home and is found cached there."""

    def ask(t: float, doc: str, tokens: int) -> TraceRecord:
        return TraceRecord(
            t, "qwen3.6", tokens + 100, 4 * tokens, 100, True, None, doc, None, tokens
        )

    settings = policy()
    profiles = cluster_profiles(settings)
    heavy = next(c for c in settings.clusters if "heavy" in c.name)
    assert capacity_read(profiles[heavy.name], "vllm") == 3_000_000
    assert capacity_read(profiles[heavy.name], "sglang") is None  # exports no cache config
    # doc-a makes the first endpoint its home, the larger doc-b the other (the fewest held).
    trace = [ask(0.0, "doc-a", 150_000), ask(0.01, "doc-b", 250_000)]
    trace.append(ask(1200.0, "doc-b", 250_000))
    sim = FleetSim(settings, profiles, prefix=PrefixSim("chain"))
    out = sim.run(trace)
    for url in heavy.endpoints:
        assert sim.index.capacity(url) == 3_000_000 // settings.prefix_index.block_tokens
    assert out.outcomes[2].cached_tokens >= 249_000  # on its home: nowhere else holds it


def test_new_home_slack_zero_reads_a_new_document_away_from_running_questions() -> None:
    """The heavy lane's ``new_home_slack``: doc-a (150k tokens) lives on one endpoint, doc-b
    (250k) on the other. A question on doc-a is running on its home when a new 200k-token
    document arrives; a second question on doc-a follows two seconds later. With the default
    slack (0.5) the new document goes to doc-a's home (one slot of four busy, fewer blocks
    held) and the second question waits behind its read; with 0 (the bench's) it goes to the
    idle endpoint and the second question is answered in seconds."""

    def ask(t: float, doc: str, tokens: int) -> TraceRecord:
        return TraceRecord(
            t, "qwen3.6", tokens + 100, 4 * tokens, 100, True, None, doc, None, tokens
        )

    trace = [ask(0.0, "doc-a", 150_000), ask(0.01, "doc-b", 250_000)]
    trace += [ask(300.0, "doc-a", 150_000), ask(300.5, "doc-c", 200_000)]
    trace.append(ask(302.0, "doc-a", 150_000))
    base = policy()
    seconds = {}
    for slack in (0.5, 0.0):
        lanes = tuple(
            lane.model_copy(update={"new_home_slack": slack}) if lane.name == "heavy" else lane
            for lane in base.lanes
        )
        settings = base.model_copy(update={"lanes": lanes})
        out = FleetSim(settings, cluster_profiles(settings), prefix=PrefixSim("chain")).run(trace)
        second = out.outcomes[4]
        assert second.cached_tokens >= 149_000
        seconds[slack] = second.e2e
    assert seconds[0.5] is not None and seconds[0.5] > 30
    assert seconds[0.0] is not None and seconds[0.0] < 10
