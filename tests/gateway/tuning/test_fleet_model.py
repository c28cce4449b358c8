"""The replay models the live path (gateway/tuning/fleet_model.py in gateway/tuning/fleet_sim.py):
wall-clock costs converted by the time scale, the gateway's work served one request at a time, the
engine stamping the arrival when the request reaches it, slots held until the relay ends, the picker
breaking ties on a scraped ``waiting``, the queue's wall-clock wait limit."""

from __future__ import annotations

import math

import pytest

from gateway.observe.trace import TraceRecord
from gateway.settings import Settings, parse_settings
from gateway.tuning.fleet_model import LiveCosts
from gateway.tuning.fleet_result import SimulatedRequest
from gateway.tuning.fleet_sim import FleetSim, _Ticket
from gateway.tuning.replay import cluster_profiles
from tests.conftest import lanes_config


def _settings(per_endpoint: int = 32, max_wait_s: float = 10.0) -> Settings:
    config = lanes_config(["http://f1", "http://f2"], ["http://h1"], threshold=32768)
    config["clusters"][0]["sim_profile"] = "h100-fast"
    config["clusters"][1]["sim_profile"] = "h100-heavy"
    config["lanes"][0]["slots"]["per_endpoint"] = per_endpoint
    config["lanes"][0]["queue"]["max_wait_s"] = max_wait_s
    return parse_settings(config, environ={})


def _small(t: float, tokens: int = 3000, output: int = 30) -> TraceRecord:
    return TraceRecord(t, "qwen3.6", tokens, tokens * 4, output)


def _run(trace: list[TraceRecord], costs: LiveCosts, **policy: float) -> list[SimulatedRequest]:
    settings = _settings(**policy)  # type: ignore[arg-type]
    return list(FleetSim(settings, cluster_profiles(settings), live=costs).run(trace).outcomes)


def test_costs_are_wall_time_and_grow_on_the_engines_clock_as_they_speed_up() -> None:
    costs = LiveCosts(time_scale=0.05, gateway_s=0.002, forward_s=0.003, relay_s=0.001)
    assert costs.to_engine(0.004) == pytest.approx(0.08)
    assert costs.to_gateway(0) == pytest.approx(0.04)
    assert costs.to_engine_arrival(0) == pytest.approx(0.06)
    assert costs.relay() == pytest.approx(0.02)
    with_tokens = LiveCosts(time_scale=1.0, gateway_s=0, forward_s=0, per_mtoken_s=0.1)
    assert with_tokens.to_gateway(1_000_000) + with_tokens.to_engine_arrival(
        1_000_000
    ) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="time_scale"):
        LiveCosts(time_scale=0)
    with pytest.raises(ValueError, match="relay_s"):
        LiveCosts(relay_s=-1)


def test_the_gateway_serves_a_burst_one_request_at_a_time() -> None:
    costs = LiveCosts(time_scale=1.0, gateway_s=0.01, per_mtoken_s=0.0)
    # Three sent together queue for the gateway; one sent later finds it free.
    times = costs.gateway_times([(0.0, 100), (0.0, 100), (0.0, 100), (1.0, 100)])
    assert times == pytest.approx([0.01, 0.02, 0.03, 1.01])
    # Order of sending, not of the list.
    assert costs.gateway_times([(1.0, 1), (0.0, 1)]) == pytest.approx([1.01, 0.01])


def test_a_lone_request_pays_the_live_path_on_top_of_the_engine() -> None:
    trace = [_small(0.0)]
    scale = 0.1
    costs = LiveCosts(scale, gateway_s=0.002, forward_s=0.003, relay_s=0.001, per_mtoken_s=0)
    (alone,) = _run(trace, LiveCosts.none(scale))
    (live,) = _run(trace, costs)
    assert live.ttft is not None and alone.ttft is not None
    assert live.ttft - alone.ttft == pytest.approx((0.002 + 0.003 + 0.001) / scale)
    assert live.e2e is not None and alone.e2e is not None
    assert live.e2e - alone.e2e == pytest.approx((0.002 + 0.003 + 0.001) / scale)


def test_a_request_holds_its_slot_until_the_relay_of_its_last_token_ends() -> None:
    # One slot per fast endpoint, two endpoints: the third request waits for a release.
    trace = [_small(0.0), _small(0.0), _small(0.0)]
    relay = LiveCosts(time_scale=1.0, gateway_s=0, forward_s=0, relay_s=0.5, per_mtoken_s=0)
    none = LiveCosts.none(1.0)
    first, second, third = _run(trace, relay, per_endpoint=1)
    base = _run(trace, none, per_endpoint=1)
    assert third.admitted is not None and base[2].admitted is not None
    # Admitted only when the first finished AND its last token reached the client.
    assert third.admitted == pytest.approx(min(first.finished or 0, second.finished or 0))
    assert third.admitted - base[2].admitted == pytest.approx(0.5, abs=1e-6)


def test_the_picker_breaks_ties_on_the_scraped_waiting_count() -> None:
    settings = _settings()
    profiles = cluster_profiles(settings)
    lane = settings.lanes[0]
    ticket = _Ticket("r0", _small(0.0), lane, lane.clusters, "standard", 0, ())
    sim = FleetSim(settings, profiles, live=LiveCosts())
    f1, f2 = sim.engines["fast"]
    f1.scraped_waiting, f2.scraped_waiting = 3.0, 0.0
    assert [e.url for e, _ in sim._candidates(ticket, 0.0)] == ["http://f2", "http://f1"]
    # The engine alone (the old model): no scrape modelled, ties break on the URL.
    plain = FleetSim(settings, profiles, live=LiveCosts.none())
    plain.run([_small(0.0)])
    assert all(e.scraped_waiting is None for e in plain.engines["fast"])


def test_scrapes_run_every_interval_of_wall_time_while_there_is_work() -> None:
    settings = _settings()
    sim = FleetSim(settings, cluster_profiles(settings), live=LiveCosts(time_scale=0.1))
    trace = [_small(float(t)) for t in range(0, 200, 20)]
    result = sim.run(trace)
    assert all(o.rejected is None for o in result.outcomes)
    # 5 s of wall time is 50 s of the engines' clock: the last scrape saw the idle engines.
    assert all(e.scraped_waiting == 0.0 for e in sim.engines["fast"])
    assert not math.isnan(result.makespan) and result.makespan < 200


def test_the_queue_wait_limit_is_wall_time() -> None:
    # One slot per endpoint, two endpoints: two long requests take both, the third waits for
    # one of them (seconds of the engines' clock) against a 2 s wall-clock limit.
    long = _small(0.0, tokens=30_000, output=400)
    trace = [long, long, _small(0.1)]
    real = _run(trace, LiveCosts.none(1.0), per_endpoint=1, max_wait_s=2.0)
    assert real[0].e2e is not None and real[0].e2e > 3.0
    assert real[2].rejected == "queue_timeout"
    # Engines ten times faster than wall time: 2 s of wall time is 20 s of theirs.
    fast = _run(trace, LiveCosts.none(0.1), per_endpoint=1, max_wait_s=2.0)
    assert fast[2].rejected is None
    assert fast[2].queue_wait is not None and fast[2].queue_wait > 2.0
