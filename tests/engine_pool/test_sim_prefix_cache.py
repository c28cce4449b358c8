"""The simulated engine's prefix cache: a block LRU; a hit skips that prefill."""

from __future__ import annotations

from engine_pool.sim.prefix_cache import BlockCache
from engine_pool.sim.profile import SchedulerLimits
from engine_pool.sim.scheduler import Scheduler
from tests.engine_pool.test_sim_scheduler import COSTS, limits, run


def test_only_the_leading_run_of_held_blocks_is_a_hit_and_the_lru_evicts_the_oldest() -> None:
    cache = BlockCache(4)
    cache.store(["a0", "a1", "a2"])
    assert cache.hit(["a0", "a1", "x", "a2"]) == 2
    cache.store(["b0", "b1"])  # 5 blocks for 4 places: a2, the least recently used, goes
    assert cache.peek(["a0", "a1", "a2"]) == 2 and len(cache) == 4


def prefill_time(cache: BlockCache | None, blocks: list[str]) -> tuple[float, int]:
    sched = Scheduler(limits(), COSTS, cache=cache, block_tokens=1000)
    sched.add("r", 100_000, 1, 0.0, blocks)
    steps = run(sched)
    return steps[-1].end, sched.hits.get("r", 0)


def test_a_cached_prefix_skips_its_prefill() -> None:
    doc = [f"d{i}" for i in range(100)]
    cold, hit = prefill_time(BlockCache(1000), doc)
    assert hit == 0
    cache = BlockCache(1000)
    cache.store(doc[:90])
    warm, hit = prefill_time(cache, doc)
    assert hit == 90_000
    assert warm < cold / 5
    whole = BlockCache(1000)
    whole.store(doc)
    assert prefill_time(whole, doc)[1] == 99_999  # the last token is always computed


def test_a_request_queued_behind_the_same_prefill_finds_it_cached() -> None:
    cache = BlockCache(1000)
    sched = Scheduler(limits(), COSTS, cache=cache, block_tokens=1000)
    doc = [f"d{i}" for i in range(50)]
    sched.add("first", 50_000, 1, 0.0, doc)
    sched.add("second", 50_000, 1, 0.0, doc)
    run(sched)
    # It is admitted in the step of the first's last chunk, after that chunk was scheduled: its
    # blocks are cached already (vLLM caches a block when it allocates its slots; checked on
    # real vLLM by tests/real/test_long_prefill.py), so all of it but the last token.
    assert sched.hits["first"] == 0
    assert sched.hits["second"] == 49_999


def test_a_request_admitted_beside_a_prefill_with_a_threshold_finds_what_was_scheduled() -> None:
    cache = BlockCache(1000)
    capped = SchedulerLimits(
        max_num_seqs=16,
        max_num_batched_tokens=8192,
        kv_capacity_tokens=10_000_000,
        long_prefill_token_threshold=2000,
    )
    sched = Scheduler(capped, COSTS, cache=cache, block_tokens=1000)
    doc = [f"d{i}" for i in range(50)]
    sched.add("first", 50_000, 1, 0.0, doc)
    first = sched.step(0.0)  # alone: the whole budget
    assert first is not None and first.prefill == (("first", 8192),)
    sched.add("second", 50_000, 1, first.end, doc)
    second = sched.step(first.end)
    # Both read on, 2,000 tokens a step: the second found the 10 blocks scheduled before it.
    assert second is not None and second.prefill == (("first", 2000), ("second", 2000))
    assert sched.hits["second"] == 10_000
