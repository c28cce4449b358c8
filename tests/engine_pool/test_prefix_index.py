"""The approximate prefix index: chained blocks, longest-prefix match, each endpoint's record
bounded by its KV capacity, TTLs and size bound."""

from __future__ import annotations

import random
import time

import pytest
from pydantic import ValidationError

from engine_pool.cluster import EngineState, EngineView
from engine_pool.prefix_index import PrefixIndex, chained_hashes, token_bytes
from engine_pool.sim.prefix_cache import BlockCache
from gateway.settings import PrefixIndexSettings


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_chained_hashes_share_the_common_prefix_only() -> None:
    a = chained_hashes(b"aaaabbbbccccdd", 4)
    b = chained_hashes(b"aaaabbbbxxxxdd", 4)
    assert len(a) == 3  # full blocks only
    assert a[:2] == b[:2] and a[2] != b[2]
    # A block's hash covers its parents: the same block after a different prefix differs.
    assert chained_hashes(b"zzzzbbbb", 4)[1] != a[1]


def test_match_is_the_longest_recorded_prefix_per_endpoint() -> None:
    index = PrefixIndex(1000, 60)
    blocks = chained_hashes(bytes(range(64)), 8)
    index.record(blocks, "a")
    index.record(blocks[:3], "b")
    assert index.match(blocks) == {"a": 8, "b": 3}
    assert index.match(chained_hashes(b"other" * 20, 8)) == {}
    index.forget("a")
    assert index.match(blocks) == {"b": 3}


def test_entries_expire_after_the_ttl() -> None:
    clock = Clock()
    index = PrefixIndex(1000, 10, clock)
    blocks = chained_hashes(bytes(64), 8)
    index.record(blocks, "a")
    clock.now = 9.0
    assert index.match(blocks) == {"a": 8}
    clock.now = 10.5
    assert index.match(blocks) == {}
    index.record(chained_hashes(b"x" * 8, 8), "b")  # a record trims what expired
    assert index.blocks == 1 and index.expired == 8


def test_the_size_bound_evicts_the_least_recent_and_cuts_prefixes_from_their_end() -> None:
    index = PrefixIndex(10, 600)
    first = chained_hashes(b"a" * 64, 8)  # 8 blocks
    index.record(first, "a")
    index.record(chained_hashes(b"b" * 32, 8), "b")  # 4 more: 2 of a's evicted
    assert index.blocks == 10 and index.evicted == 2
    assert index.match(first) == {"a": 6}  # its last two blocks went first


def test_match_agrees_with_a_brute_force_reading_of_what_was_sent() -> None:
    """Any clock (a simulation's starts at 0), shared and unique blocks, the TTL in play."""
    clock = Clock()
    index = PrefixIndex(1_000_000, 5.0, clock)
    sent: dict[str, dict[int, float]] = {}
    rng = random.Random(2)
    prefixes = [[rng.getrandbits(60) for _ in range(rng.randint(1, 50))] for _ in range(30)]
    for _ in range(5000):
        clock.now += rng.random() * 0.05
        hashes = rng.choice(prefixes) + [rng.getrandbits(60) for _ in range(rng.randint(0, 20))]
        expected = {}
        for url, blocks in sent.items():
            n = 0
            while n < len(hashes) and blocks.get(hashes[n], -1e9) >= clock.now - 5.0:
                n += 1
            if n:
                expected[url] = n
        assert index.match(hashes) == expected
        url = f"u{rng.randrange(4)}"
        index.record(hashes, url)
        sent.setdefault(url, {}).update(dict.fromkeys(hashes, clock.now))


def view(url: str, kv_tokens: int | None) -> EngineView:
    return EngineView("c", url, EngineState.UP, 0, kv_capacity_tokens=kv_tokens)


def test_an_endpoints_record_never_exceeds_its_kv_capacity_and_forgets_as_its_cache_does() -> None:
    """Shared prefixes and unique tails to three endpoints: two whose engines report their KV
    cache (50 and 80 blocks of 16 tokens), one that does not. A known endpoint's record never
    holds more blocks than its cache, and what it believes held is exactly what a block LRU of
    that size holds (the simulated engine's prefix cache, driven as the fleet simulator drives
    it); the unknown one is bounded by the TTL and the global bound only, as before."""
    index = PrefixIndex(1_000_000, 1e9, block_tokens=16)
    index.learn([view("a", 50 * 16), view("b", 80 * 16 + 15), view("u", None)])
    assert (index.capacity("a"), index.capacity("b"), index.capacity("u")) == (50, 80, None)
    caches = {"a": BlockCache(50), "b": BlockCache(80)}
    sent_to_u: set[int] = set()
    rng = random.Random(3)
    prefixes = [[rng.getrandbits(60) for _ in range(rng.randint(5, 40))] for _ in range(12)]
    for _ in range(3000):
        hashes = rng.choice(prefixes) + [rng.getrandbits(60) for _ in range(rng.randint(0, 15))]
        url = rng.choice("abu")
        believed = index.match(hashes)
        for known, cache in caches.items():
            assert believed.get(known, 0) == cache.peek(hashes)
        index.record(hashes, url)
        if url in caches:
            caches[url].hit(hashes)
            caches[url].store(hashes)
        else:
            sent_to_u.update(hashes)
        assert index.held_by("a") <= 50 and index.held_by("b") <= 80
    assert index.held_by("a") == 50 and index.held_by("b") == 80
    assert index.held_by("u") == len(sent_to_u)  # no capacity known: nothing overflowed
    assert index.overflowed > 0 and index.evicted == 0


def test_a_smaller_capacity_trims_at_once_and_an_unknown_one_lifts_the_bound() -> None:
    index = PrefixIndex(1_000_000, 600, block_tokens=4)
    first = chained_hashes(bytes(range(80)), 8)  # 10 blocks
    index.record(first, "a")
    index.learn([view("a", 6 * 4)])  # the engine came back with a 6-block cache
    assert index.held_by("a") == 6 and index.match(first) == {"a": 6}  # cut from its end
    index.learn([view("a", None)])  # its metric is gone: unknown, unbounded again
    index.record(first, "a")
    assert index.held_by("a") == 10 and index.capacity("a") is None


def test_an_entry_within_capacity_outlives_the_ttl_of_an_endpoint_of_unknown_capacity() -> None:
    """The default settings: an endpoint whose KV cache is known keeps a block it still has
    room for past ``ttl_s`` (600 s: the engine still holds it) until ``backstop_ttl_s``
    (3600 s); one whose cache is unknown forgets it after ``ttl_s``, as before."""
    settings = PrefixIndexSettings()
    assert (settings.ttl_s, settings.backstop_ttl_s) == (600.0, 3600.0)
    clock = Clock()
    index = PrefixIndex(
        settings.max_blocks,
        settings.ttl_s,
        clock,
        block_tokens=settings.block_tokens,
        backstop_ttl_s=settings.backstop_ttl_s,
    )
    index.learn([view("known", 1000 * settings.block_tokens), view("unknown", None)])
    document = chained_hashes(bytes(range(256)) * 8, 64)  # 32 blocks
    index.record(document, "known")
    index.record(document, "unknown")
    clock.now = 601.0
    assert index.match(document) == {"known": 32}
    clock.now = 3599.0
    index.record(chained_hashes(b"x" * 64, 64), "unknown")  # a record trims what expired
    assert index.match(document) == {"known": 32} and index.held_by("unknown") == 1
    clock.now = 3601.0
    assert index.match(document) == {}


def test_the_backstop_ttl_is_a_knob_that_never_forgets_sooner_than_ttl_s() -> None:
    clock = Clock()
    index = PrefixIndex(1000, 600, clock, block_tokens=1, backstop_ttl_s=900)
    index.learn([view("known", 100)])
    blocks = chained_hashes(bytes(32), 8)
    index.record(blocks, "known")
    clock.now = 899.0
    assert index.match(blocks) == {"known": 4}
    clock.now = 901.0
    assert index.match(blocks) == {}
    assert PrefixIndexSettings(ttl_s=60, backstop_ttl_s=60).backstop_ttl_s == 60
    with pytest.raises(ValidationError, match="backstop_ttl_s"):
        PrefixIndexSettings(ttl_s=600, backstop_ttl_s=300)


def test_unique_prefixes_never_grow_it_past_its_bound() -> None:
    index = PrefixIndex(5000, 600)
    rng = random.Random(1)
    for i in range(2000):
        index.record(chained_hashes(rng.randbytes(256), 16), f"e{i % 4}")
        assert index.blocks <= 5000
    assert index.blocks == 5000


def test_lookup_of_a_200k_token_prompt_is_under_2_ms() -> None:
    """At the default 128-token block (gateway/settings.py ``prefix_index.block_tokens``);
    16-token blocks are timed and printed too (8x the hashing)."""
    ids = [random.randrange(150_000) for _ in range(200_000)]
    data = token_bytes(ids)
    best: dict[int, float] = {}
    for block in (128, 16):
        index = PrefixIndex(1_000_000, 600)
        index.record(chained_hashes(data, block * 4), "a")
        best[block] = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            found = index.match(chained_hashes(data, block * 4))
            best[block] = min(best[block], time.perf_counter() - started)
        assert found == {"a": 200_000 // block}
    print(
        f"prefix index lookup, 200k tokens: {best[128] * 1000:.2f} ms (128-token blocks), "
        f"{best[16] * 1000:.2f} ms (16-token blocks)"
    )
    assert best[128] < 0.002
