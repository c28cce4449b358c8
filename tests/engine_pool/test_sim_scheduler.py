"""The simulated engine's scheduler: vLLM V1's step rules, in simulated time (no sleeping)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_pool.sim.costs import isolated_prefill_seconds, prefill_chunk_cost, step_cost
from engine_pool.sim.profile import (
    CostParams,
    ProfileError,
    SchedulerLimits,
    load_profile,
    parse_profile,
)
from engine_pool.sim.scheduler import Scheduler, StepResult

COSTS = CostParams(
    step_overhead_s=0.02,
    prefill_s_per_token=1e-5,
    prefill_s_per_token_per_context_token=1e-9,
    decode_s_per_seq=0.001,
    decode_s_per_kv_token=1e-7,
    decode_kv_read_cap_tokens=4096,
)


def limits(
    seqs: int = 16, budget: int = 8192, kv: int = 10_000_000, threshold: int = 0
) -> SchedulerLimits:
    return SchedulerLimits(
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
        kv_capacity_tokens=kv,
        long_prefill_token_threshold=threshold,
    )


def run(sched: Scheduler, now: float = 0.0, max_steps: int = 10_000) -> list[StepResult]:
    steps: list[StepResult] = []
    while sched.has_work and len(steps) < max_steps:
        result = sched.step(now)
        assert result is not None
        steps.append(result)
        now = result.end
    return steps


def test_chunked_prefill_then_one_token_per_step() -> None:
    sched = Scheduler(limits(), COSTS)
    sched.add("a", prompt_tokens=20_000, output_tokens=3, arrival=0.0)
    steps = run(sched)
    assert [s.prefill for s in steps[:3]] == [(("a", 8192),), (("a", 8192),), (("a", 3616),)]
    # The step that completes the prompt samples the first token; then one token a step.
    assert steps[2].first_tokens == ("a",)
    assert [s.tokens for s in steps] == [(), (), ("a",), ("a",), ("a",)]
    assert steps[-1].finished == ("a",)
    assert not sched.has_work


def test_waiting_request_queues_behind_a_long_prefill() -> None:
    sched = Scheduler(limits(), COSTS)
    sched.add("monster", prompt_tokens=100_000, output_tokens=2, arrival=0.0)
    sched.add("small", prompt_tokens=3000, output_tokens=2, arrival=0.0)
    steps = run(sched)
    monster_done = next(i for i, s in enumerate(steps) if "monster" in s.first_tokens)
    small_start = next(i for i, s in enumerate(steps) if any(k == "small" for k, _ in s.prefill))
    # The small prompt gets nothing until the monster's last chunk leaves budget over.
    assert small_start == monster_done
    assert steps[monster_done].prefill == (("monster", 100_000 - 12 * 8192), ("small", 3000))


def test_a_long_prefill_threshold_lets_a_short_prompt_run_beside_a_long_one() -> None:
    sched = Scheduler(limits(threshold=4096), COSTS)
    sched.add("monster", prompt_tokens=100_000, output_tokens=2, arrival=0.0)
    sched.add("small", prompt_tokens=3000, output_tokens=2, arrival=0.0)
    steps = run(sched)
    # The monster takes the threshold, the small prompt the rest: its first token comes at once.
    assert steps[0].prefill == (("monster", 4096), ("small", 3000))
    assert steps[0].first_tokens == ("small",)
    # Once it has left, the monster is alone and takes the whole budget again (as vLLM does).
    assert steps[1].prefill == (("monster", 4096),)  # the small one is decoding its last token
    assert steps[2].prefill == (("monster", 8192),)


def test_with_a_threshold_two_long_prompts_prefill_side_by_side() -> None:
    sched = Scheduler(limits(threshold=3000), COSTS)
    sched.add("a", prompt_tokens=20_000, output_tokens=1, arrival=0.0)
    sched.add("b", prompt_tokens=20_000, output_tokens=1, arrival=0.0)
    first = sched.step(0.0)
    assert first is not None and first.prefill == (("a", 3000), ("b", 3000))
    second = sched.step(first.end)
    assert second is not None and second.prefill == (("a", 3000), ("b", 3000))


def test_without_a_threshold_the_budget_goes_to_the_first_prompt() -> None:
    sched = Scheduler(limits(), COSTS)
    sched.add("a", prompt_tokens=20_000, output_tokens=1, arrival=0.0)
    sched.add("b", prompt_tokens=20_000, output_tokens=1, arrival=0.0)
    first = sched.step(0.0)
    assert first is not None and first.prefill == (("a", 8192),)


def test_a_threshold_above_the_context_is_refused_as_vllm_refuses_it() -> None:
    data = load_profile("h100-fast").model_dump()
    data["scheduler"]["long_prefill_token_threshold"] = data["max_model_len"] + 1
    with pytest.raises(ProfileError, match="long_prefill_token_threshold"):
        parse_profile(data)


def test_decodes_share_every_step_with_the_prefill_chunk() -> None:
    sched = Scheduler(limits(), COSTS)
    sched.add("small", prompt_tokens=1000, output_tokens=50, arrival=0.0)
    first = sched.step(0.0)
    assert first is not None and first.first_tokens == ("small",)
    sched.add("monster", prompt_tokens=50_000, output_tokens=1, arrival=first.end)
    nxt = sched.step(first.end)
    assert nxt is not None
    assert nxt.tokens == ("small",) and nxt.prefill == (("monster", 8191),)
    # The decode waits for the whole chunk: its token takes as long as the prefill step.
    assert nxt.duration == pytest.approx(step_cost(COSTS, [(0, 8191)], [1001]), rel=1e-12)


def test_max_num_seqs_holds_the_queue_until_a_seat_frees() -> None:
    sched = Scheduler(limits(seqs=2), COSTS)
    for key in "abc":
        sched.add(key, prompt_tokens=10, output_tokens=5 if key == "a" else 50, arrival=0.0)
    first = sched.step(0.0)
    assert first is not None and set(first.first_tokens) == {"a", "b"}
    assert sched.snapshot().waiting == 1
    steps = run(sched, first.end)
    c_start = next(s for s in steps if "c" in s.first_tokens)
    a_end = next(s for s in steps if "a" in s.finished)
    assert c_start.start == a_end.end


def test_kv_capacity_makes_requests_wait_and_abort_frees_it_at_once() -> None:
    sched = Scheduler(limits(kv=10_000), COSTS)
    sched.add("big", prompt_tokens=6000, output_tokens=1000, arrival=0.0)
    sched.add("next", prompt_tokens=3000, output_tokens=100, arrival=0.0)
    first = sched.step(0.0)
    assert first is not None and first.prefill == (("big", 6000),)
    assert sched.snapshot().waiting == 1  # 7000 reserved + 3100 > 10_000
    assert sched.abort("big")
    snap = sched.snapshot()
    assert (snap.running, snap.kv_reserved_tokens, snap.kv_used_tokens) == (0, 0, 0)
    second = sched.step(first.end)
    assert second is not None and second.prefill == (("next", 3000),)


def test_abort_of_the_partial_prefill_lets_the_next_request_in() -> None:
    sched = Scheduler(limits(), COSTS)
    sched.add("monster", prompt_tokens=200_000, output_tokens=1, arrival=0.0)
    sched.add("small", prompt_tokens=100, output_tokens=1, arrival=0.0)
    sched.step(0.0)
    assert sched.abort("monster") and not sched.abort("monster")
    result = sched.step(1.0)
    assert result is not None and result.prefill == (("small", 100),)


def test_requests_from_the_future_are_not_admitted() -> None:
    sched = Scheduler(limits(), COSTS)
    sched.add("later", prompt_tokens=10, output_tokens=1, arrival=5.0)
    assert sched.step(1.0) is None
    assert sched.next_arrival() == 5.0
    assert sched.step(5.0) is not None


def test_invalid_requests_are_refused() -> None:
    sched = Scheduler(limits(kv=1000), COSTS)
    with pytest.raises(ValueError, match="KV"):
        sched.add("x", prompt_tokens=990, output_tokens=20, arrival=0.0)
    sched.add("y", prompt_tokens=1, output_tokens=1, arrival=0.0)
    with pytest.raises(ValueError, match="duplicate"):
        sched.add("y", prompt_tokens=1, output_tokens=1, arrival=0.0)


arrivals = st.lists(
    st.tuples(st.floats(0, 50), st.integers(1, 40_000), st.integers(1, 40), st.booleans()),
    min_size=1,
    max_size=40,
)


@settings(max_examples=80, deadline=None)
@given(arrivals, st.integers(1, 6), st.integers(64, 9000), st.sampled_from([0, 0, 700, 4096]))
def test_every_step_respects_vllm_limits(
    reqs: list[tuple[float, int, int, bool]], seqs: int, budget: int, threshold: int
) -> None:
    lim = limits(seqs=seqs, budget=max(budget, seqs), kv=100_000, threshold=threshold)
    sched = Scheduler(lim, COSTS)
    pending = sorted(enumerate(reqs), key=lambda r: r[1][0])
    admitted: list[int] = []
    now, i = 0.0, 0
    aborted: set[int] = set()
    for _ in range(20_000):
        while i < len(pending) and pending[i][1][0] <= now:
            index, (at, prompt, out, _) = pending[i]
            sched.add(str(index), prompt, out, at)
            i += 1
        if not sched.has_work and i == len(pending):
            break
        result = sched.step(now)
        if result is None:
            now = pending[i][1][0]
            continue
        snap = sched.snapshot()
        assert snap.running <= lim.max_num_seqs
        assert snap.kv_reserved_tokens <= lim.kv_capacity_tokens
        assert sum(n for _, n in result.prefill) + result.decodes <= lim.max_num_batched_tokens
        if threshold == 0:
            # At most one request is left part-way through its prefill.
            assert len(result.prefill) - len(result.first_tokens) <= 1
        elif len(result.prefill) + result.decodes > 1:
            # Not alone: no prompt computed more than the threshold.
            assert all(n <= threshold for _, n in result.prefill)
        for name, _ in result.prefill:
            if int(name) not in admitted:
                admitted.append(int(name))
        now = result.end
        # Abort some requests once they produced a token, as disconnecting clients do.
        for name in result.tokens:
            if reqs[int(name)][3] and int(name) not in aborted:
                aborted.add(int(name))
                sched.abort(name)
    assert not sched.has_work
    # First come, first served: admission order is arrival order.
    order = [k for k, _ in pending]
    assert admitted == order


def test_prefill_cost_grows_with_the_context_attended() -> None:
    assert prefill_chunk_cost(COSTS, 300_000, 8192) > 10 * prefill_chunk_cost(COSTS, 0, 8192)
    # The whole prefill is quadratic: twice the prompt costs well over twice the time.
    short = isolated_prefill_seconds(COSTS, 100_000, 8192)
    assert isolated_prefill_seconds(COSTS, 200_000, 8192) > 2.5 * short


def test_vllm_refuses_concurrent_partial_prefills() -> None:
    data = load_profile("h100-shared").model_dump()
    data["scheduler"]["max_num_partial_prefills"] = 2
    with pytest.raises(ProfileError, match="Concurrent Partial Prefill is not supported"):
        parse_profile(data)


def test_profile_refuses_a_kv_cache_smaller_than_one_sequence() -> None:
    data = load_profile("h100-fast").model_dump()
    data["scheduler"]["kv_capacity_tokens"] = 1000
    with pytest.raises(ProfileError, match="kv_capacity_tokens"):
        parse_profile(data)
    data = load_profile("h100-fast").model_dump()
    data["scheduler"]["surprise"] = 1
    with pytest.raises(ProfileError, match="surprise"):
        parse_profile(data)
