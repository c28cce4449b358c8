"""Passive ejection and slow start (engine_pool/outlier.py) and how the pool applies them."""

from __future__ import annotations

import time

import pytest

from engine_pool.cluster import Cluster, EngineState
from engine_pool.outlier import judge_failure, ramp, ramped_limit
from engine_pool.registry import EnginePool


def pool(*urls: str, slow_start_s: float = 0.0) -> EnginePool:
    return EnginePool([Cluster("c", "vllm", urls, slow_start_s=slow_start_s)])


@pytest.mark.parametrize(
    ("failures", "refused", "others", "eject"),
    [
        (1, True, 1, False),  # below the threshold of 2
        (2, False, 1, True),
        (2, False, 0, False),  # the cap: the last routable endpoint stays unless it refuses
        (2, True, 0, True),
    ],
)
def test_judge_failure(failures: int, refused: bool, others: int, eject: bool) -> None:
    assert judge_failure(failures, 2, refused=refused, others_routable=others) is eject


def test_ramp_and_ramped_limit() -> None:
    assert ramp(None, 10, 5.0) == 1.0
    assert ramp(100.0, 0, 101.0) == 1.0
    assert ramp(100.0, 10, 102.5) == 0.25
    assert ramp(100.0, 10, 200.0) == 1.0
    assert ramped_limit(64, 0.0) == 1  # never zero: a warming endpoint still takes one
    assert ramped_limit(64, 0.25) == 16
    assert ramped_limit(64, 1.0) == 64


def test_connect_failures_in_a_row_eject_and_an_answer_resets_the_count() -> None:
    p = pool("http://a", "http://b")
    assert p.unreachable("c", "http://a", refused=False, eject_after=2, why="reset") is None
    assert p.answered("c", "http://a", 200, 0) is None  # the run is broken
    assert p.unreachable("c", "http://a", refused=False, eject_after=2, why="reset") is None
    change = p.unreachable("c", "http://a", refused=False, eject_after=2, why="reset")
    assert change is not None and change.new is EngineState.DOWN
    assert change.evidence == "ejected: 2 requests in a row: reset"
    assert p.engine("c", "http://a").state is EngineState.DOWN
    # b is now the last routable one: resets do not eject it, refusals do.
    for _ in range(5):
        assert p.unreachable("c", "http://b", refused=False, eject_after=2, why="reset") is None
    assert p.unreachable("c", "http://b", refused=True, eject_after=2, why="refused") is not None


def test_5xx_ejection_is_off_unless_configured() -> None:
    p = pool("http://a", "http://b")
    for _ in range(10):
        assert p.answered("c", "http://a", 500, 0) is None
    assert p.answered("c", "http://a", 503, 3) is not None  # the 11th 5xx in a row


def test_an_endpoint_back_from_down_slow_starts() -> None:
    p = pool("http://a", slow_start_s=10)
    assert p.views("c")[0].ramp == 1.0  # at boot: full admission
    p.set_state("c", "http://a", EngineState.DOWN, "probe failed")
    change = p.set_state("c", "http://a", EngineState.UP, "probe ok")
    assert change is not None and change.slow_start_s == 10
    (view,) = p.views("c")
    assert 0.0 <= view.ramp < 0.1
    shown = p.engine("c", "http://a").as_json(time.time())["slow_start"]
    assert shown["window_s"] == 10 and shown["share"] < 0.1


def test_an_endpoint_that_joins_on_reload_slow_starts() -> None:
    p = pool("http://a", slow_start_s=5)
    joined = p.reconcile([Cluster("c", "vllm", ("http://a", "http://b"), slow_start_s=5)])
    assert [e.url for e in joined] == ["http://b"]
    ramps = {v.url: v.ramp for v in p.views("c")}
    assert ramps["http://a"] == 1.0 and ramps["http://b"] < 0.1
