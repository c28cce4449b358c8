"""An endpoint slow among its peers is told apart by the requests it served, never by the clock
alone: heavy lanes are slow on purpose, so the yardstick is the cluster's other endpoints."""

from __future__ import annotations

from engine_pool.latency import LatencyBook, judge, size_class


def book_of(ttfts: dict[str, list[float]], prompt_tokens: int = 500) -> LatencyBook:
    book = LatencyBook(window_s=60)
    for url, values in ttfts.items():
        for i, ttft in enumerate(values):
            book.observe("fast", url, prompt_tokens, ttft, 0.02, now=float(i))
    return book


def test_an_endpoint_many_times_slower_than_its_peers_is_slow_with_evidence() -> None:
    book = book_of({"a": [0.2] * 8, "b": [0.25] * 8, "c": [8.0] * 8})
    verdicts = judge(book, now=10.0)
    assert verdicts[("fast", "a")].slow is None and verdicts[("fast", "b")].slow is None
    evidence = verdicts[("fast", "c")].slow
    assert evidence is not None
    assert "TTFT median 8.0 s over 8 requests of <1k tokens" in evidence
    assert "2 peers" in evidence
    assert verdicts[("fast", "c")].ttft_p95 == 8.0


def test_uniformly_slow_clusters_noise_and_few_samples_are_not_slow() -> None:
    # A heavy lane where every engine takes minutes: nobody is an outlier.
    assert all(
        v.slow is None for v in judge(book_of({"a": [90.0] * 8, "b": [95.0] * 8}), 10).values()
    )
    # 4x slower, but by milliseconds: below the floor.
    assert all(
        v.slow is None for v in judge(book_of({"a": [0.01] * 8, "b": [0.04] * 8}), 10).values()
    )
    # Too few samples to judge.
    assert all(
        v.slow is None for v in judge(book_of({"a": [0.2] * 8, "b": [9.0] * 3}), 10).values()
    )
    # No peer at all.
    assert judge(book_of({"a": [9.0] * 8}), 10)[("fast", "a")].slow is None


def test_prompts_are_compared_with_prompts_of_similar_size() -> None:
    book = LatencyBook(window_s=60)
    for i in range(8):
        book.observe("heavy", "a", 200_000, 60.0, 0.05, now=i)  # long prefills
        book.observe("heavy", "b", 2_000, 1.0, 0.05, now=i)  # short prompts only
    verdicts = judge(book, now=10)
    assert verdicts[("heavy", "a")].slow is None  # nothing of its size to compare with
    assert size_class(500) == 0 and size_class(2_000) == 1 and size_class(200_000) == 4


def test_inter_token_time_outliers_count_too_and_old_samples_expire() -> None:
    book = LatencyBook(window_s=60)
    for i in range(8):
        book.observe("fast", "a", 500, 0.2, 0.02, now=i)
        book.observe("fast", "b", 500, 0.2, 0.5, now=i)
    evidence = judge(book, now=10)[("fast", "b")].slow
    assert evidence is not None and evidence.startswith("time per output token median 500 ms")
    expired = judge(book, now=100)
    assert all(v.slow is None and v.ttft_p95 is None for v in expired.values())
