"""engine_pool/registry.py ``EnginePool.track``: a request counted in flight on its endpoint for
exactly as long as its block runs (an error inside included), its scope cancelled when the
endpoint goes down, a reload's removed endpoint forgotten when its last request ends."""

from __future__ import annotations

import pytest

from engine_pool.cluster import Cluster, EngineState
from engine_pool.registry import EnginePool


class _Scope:
    def __init__(self) -> None:
        self.cancelled = 0

    def cancel(self) -> None:
        self.cancelled += 1


def _pool(*urls: str) -> EnginePool:
    return EnginePool([Cluster("c", "vllm", urls)])


def test_track_counts_in_flight_until_the_block_exits_even_on_an_error() -> None:
    pool, scope = _pool("http://a"), _Scope()
    with pool.track("c", "http://a", scope) as engine:
        assert engine is pool.engine("c", "http://a") and engine.in_flight == 1
        with pool.track("c", "http://a", _Scope()):
            assert engine.in_flight == 2
    assert engine.in_flight == 0
    with pytest.raises(RuntimeError), pool.track("c", "http://a", scope):
        assert engine.in_flight == 1
        raise RuntimeError
    assert engine.in_flight == 0
    # Released: a later down cancels nothing.
    pool.set_state("c", "http://a", EngineState.DOWN, "probe failed")
    assert scope.cancelled == 0


def test_an_endpoint_going_down_cancels_the_scopes_tracked_on_it_only() -> None:
    pool, on_a, on_b = _pool("http://a", "http://b"), _Scope(), _Scope()
    with pool.track("c", "http://a", on_a), pool.track("c", "http://b", on_b):
        assert pool.set_state("c", "http://a", EngineState.DOWN, "probe failed") is not None
        assert (on_a.cancelled, on_b.cancelled) == (1, 0)


def test_a_removed_endpoint_is_forgotten_when_its_last_request_ends() -> None:
    pool = _pool("http://a", "http://b")
    tracked = pool.track("c", "http://a", _Scope())
    with tracked as engine:
        pool.reconcile([Cluster("c", "vllm", ("http://b",))])
        assert pool.retired() == [engine] and engine.in_flight == 1
    assert pool.retired() == [] and engine.in_flight == 0
    with pytest.raises(KeyError):
        pool.track("c", "http://a", _Scope())
