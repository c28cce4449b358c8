"""The approximate prefix index: chained blocks, longest-prefix match, TTL and size bound."""

from __future__ import annotations

import random
import time

from engine_pool.prefix_index import PrefixIndex, chained_hashes, token_bytes


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
