"""The fleet simulator's prefix caches and routers (``FleetSim(..., prefix=PrefixSim(router))``)."""

from __future__ import annotations

from typing import Any

from gateway.observe.trace import TraceRecord, synthesize
from gateway.settings import PauseSettings, Settings
from gateway.tools.bench.prefix import policy
from gateway.tuning.fleet_sim import FleetSim
from gateway.tuning.prefix_routers import PrefixSim, Router, capacity_read
from gateway.tuning.replay import cluster_profiles

ROUTERS_COMPARED: tuple[Router, ...] = ("least-loaded", "chain", "oracle")


def heavy_lane(**changes: Any) -> Settings:
    """The bench's policy with its heavy lane's settings changed."""
    base = policy()
    heavy = base.lane("heavy")
    pause = changes.pop("pause_reads", heavy.pause_reads)
    if isinstance(pause, dict):
        pause = PauseSettings(**pause)
    lane = heavy.model_copy(update={**changes, "pause_reads": pause})
    lanes = tuple(lane if x.name == "heavy" else x for x in base.lanes)
    return base.model_copy(update={"lanes": lanes})


def doc(t: float, name: str, tokens: int, output: int = 100) -> TraceRecord:
    """A question on document ``name`` (``tokens`` long, shared), its own 100 tokens after."""
    return TraceRecord(
        t, "qwen3.6", tokens + 100, 4 * tokens, output, True, None, name, None, tokens
    )


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
    seconds = {}
    for slack in (0.5, 0.0):
        # Without the bench's pause_reads, which lets the question pass the read (below).
        settings = heavy_lane(new_home_slack=slack, pause_reads=None)
        out = FleetSim(settings, cluster_profiles(settings), prefix=PrefixSim("chain")).run(trace)
        second = out.outcomes[4]
        assert second.cached_tokens >= 149_000
        seconds[slack] = second.e2e
    assert seconds[0.5] is not None and seconds[0.5] > 30
    assert seconds[0.0] is not None and seconds[0.0] < 10


def pause_trace() -> list[TraceRecord]:
    """doc-a (150k tokens) homes on one heavy endpoint, doc-b (250k) on the other; at 300 s a
    question on doc-a runs on its home when a new 200k-token document, doc-c, arrives and (with
    the default ``new_home_slack``) is read there too; a second question on doc-a follows 2 s
    later, behind doc-c's read."""
    trace = [doc(0.0, "doc-a", 150_000), doc(0.01, "doc-b", 250_000)]
    trace += [doc(300.0, "doc-a", 150_000), doc(300.5, "doc-c", 200_000)]
    trace.append(doc(302.0, "doc-a", 150_000))
    return trace


def test_pause_reads_lets_a_cached_question_pass_another_documents_read() -> None:
    """``lanes[].pause_reads``: the second question on doc-a (cached on its home) pauses
    doc-c's read there, is answered in seconds instead of waiting for the read, and the read
    goes on from the blocks it had computed, a few seconds later than it would have ended."""
    out = {}
    for pause in (None, {}):
        settings = heavy_lane(new_home_slack=0.5, pause_reads=pause)
        sim = FleetSim(settings, cluster_profiles(settings), prefix=PrefixSim("chain"))
        out[pause is not None] = (sim.run(pause_trace()).outcomes, sim.pauses)
    (before, none), (after, paused) = out[False], out[True]
    assert none == 0 and paused == 1
    assert before[4].e2e is not None and before[4].e2e > 30
    assert after[4].e2e is not None and after[4].e2e < 10
    assert after[4].cached_tokens >= 149_000
    read_before, read_after = before[3], after[3]
    assert read_before.pauses == 0 and read_after.pauses == 1
    # Sent again, it found the blocks it had computed before the pause (vLLM keeps an aborted
    # request's blocks: tests/real/test_long_prefill.py) ...
    assert read_after.cached_tokens > 10_000
    # ... and ended no later than the question's few seconds after it would have.
    assert read_before.e2e is not None and read_after.e2e is not None
    assert read_before.e2e < read_after.e2e < read_before.e2e + after[4].e2e + 2


def test_a_question_does_not_pause_a_read_of_its_own_document_or_a_short_one() -> None:
    """The rule's limits in the simulator: a read shorter than ``read_min_tokens`` is left
    alone, and so is one for a question sent to its home with more than
    ``question_max_tokens`` uncached."""
    for pause in ({"read_min_tokens": 250_000}, {"question_max_tokens": 50}):
        settings = heavy_lane(new_home_slack=0.5, pause_reads=pause)
        sim = FleetSim(settings, cluster_profiles(settings), prefix=PrefixSim("chain"))
        outcomes = sim.run(pause_trace()).outcomes
        assert sim.pauses == 0, pause
        assert outcomes[4].e2e is not None and outcomes[4].e2e > 30


def test_a_read_is_paused_at_most_max_pauses_times() -> None:
    """Questions on doc-a keep coming every 4 s while doc-c is read on the same endpoint: the
    read is paused ``max_pauses`` times, then runs to its end."""
    trace = pause_trace()[:4]
    trace += [doc(302.0 + 4 * i, "doc-a", 150_000, output=10) for i in range(30)]
    for limit in (1, 3):
        settings = heavy_lane(new_home_slack=0.5, pause_reads={"max_pauses": limit})
        sim = FleetSim(settings, cluster_profiles(settings), prefix=PrefixSim("chain"))
        read = sim.run(trace).outcomes[3]
        assert read.pauses == limit and read.finished is not None


def test_a_request_waiting_on_a_paused_reads_blocks_is_paused_with_it() -> None:
    """doc-c is asked twice at once: the second question is sent to the read's endpoint
    believing the document cached there (the index records a prefix when it is sent). A
    question on doc-a pauses the read; the partner, believed cached, would read the rest of
    doc-c itself ahead of the question, so it is paused with it."""
    trace = pause_trace()[:4]
    trace += [doc(300.6, "doc-c", 200_000), doc(302.0, "doc-a", 150_000)]
    settings = heavy_lane(new_home_slack=0.5, pause_reads={})
    sim = FleetSim(settings, cluster_profiles(settings), prefix=PrefixSim("chain"))
    outcomes = sim.run(trace).outcomes
    read, partner, question = outcomes[3], outcomes[4], outcomes[5]
    assert read.cluster == partner.cluster
    assert read.pauses == 1 and partner.pauses == 1 and sim.pauses == 2
    assert question.e2e is not None and question.e2e < 10
