from __future__ import annotations

from engine_pool.cluster import EngineState, EngineView
from engine_pool.picker import order_endpoints


def view(
    url: str, in_flight: int = 0, state: EngineState = EngineState.UP, waiting: float | None = None
) -> EngineView:
    return EngineView(cluster="c", url=url, state=state, in_flight=in_flight, waiting=waiting)


def test_least_in_flight_first_and_down_never() -> None:
    views = [view("a", 3), view("b", 1), view("c", 0, EngineState.DOWN), view("d", 1, waiting=5)]
    assert [v.url for v in order_endpoints(views)] == ["b", "d", "a"]


def test_slow_engines_stay_routable() -> None:
    assert [v.url for v in order_endpoints([view("a", state=EngineState.SLOW)])] == ["a"]
