from __future__ import annotations

from engine_pool.cluster import EngineState
from engine_pool.health import ProbeResult, Thresholds, Track, judge
from engine_pool.load import Progress, parse_load

LIMITS = Thresholds(down_after_timeouts=3, up_after_successes=2)
OK = ProbeResult("ok", "HTTP 200", 0.01)
TIMEOUT = ProbeResult("timeout", "no answer", 10.0)
REFUSED = ProbeResult("failed", "ConnectError", 0.001)


def run(results: list[ProbeResult], progressing: bool = False) -> list[EngineState]:
    track, states = Track(), []
    for result in results:
        verdict = judge(track, result, progressing, LIMITS)
        track = verdict.track
        states.append(track.state)
    return states


def test_a_refused_connection_is_down_at_once() -> None:
    assert run([REFUSED]) == [EngineState.DOWN]


def test_timeouts_alert_first_and_evict_only_after_the_threshold() -> None:
    verdict = judge(Track(), TIMEOUT, False, LIMITS)
    assert verdict.alert is not None and verdict.track.state is EngineState.SLOW
    assert run([TIMEOUT] * 3) == [EngineState.SLOW, EngineState.SLOW, EngineState.DOWN]
    assert run([TIMEOUT, TIMEOUT, OK, TIMEOUT, TIMEOUT]) == [
        EngineState.SLOW,
        EngineState.SLOW,
        EngineState.UP,
        EngineState.SLOW,
        EngineState.SLOW,
    ]


def test_a_busy_engine_making_progress_is_slow_not_dead() -> None:
    states = run([TIMEOUT] * 20, progressing=True)
    assert set(states) == {EngineState.SLOW}


def test_recovery_needs_consecutive_successes() -> None:
    assert run([REFUSED, OK, OK]) == [EngineState.DOWN, EngineState.DOWN, EngineState.UP]
    assert run([REFUSED, OK, REFUSED, OK, OK]) == [
        EngineState.DOWN,
        EngineState.DOWN,
        EngineState.DOWN,
        EngineState.DOWN,
        EngineState.UP,
    ]


def test_vllm_and_sglang_metrics_are_read() -> None:
    vllm = (
        "# HELP vllm:num_requests_running x\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
        'vllm:num_requests_waiting{model_name="m"} 7.0\n'
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.5\n'
        'vllm:prompt_tokens_total{model_name="m"} 1000.0\n'
        'vllm:generation_tokens_total{model_name="m"} 24.0\n'
    )
    load = parse_load("vllm", vllm)
    assert (load.running, load.waiting, load.kv_usage, load.tokens_total) == (5, 7, 0.5, 1024)
    newer = vllm + 'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
    assert parse_load("vllm", newer).kv_usage == 0.25
    sglang = "sglang:num_running_reqs 4\nsglang:num_queue_reqs 1\nsglang:token_usage 0.9\n"
    load = parse_load("sglang", sglang)
    assert (load.running, load.waiting, load.kv_usage, load.tokens_total) == (4, 1, 0.9, None)
    assert parse_load("vllm", "garbage line\n").running is None


def test_progress_is_counter_movement_between_scrapes() -> None:
    progress = Progress()
    progress.update(100)
    assert not progress.advanced
    progress.update(150)
    assert progress.advanced
    progress.update(150)
    assert not progress.advanced
    progress.update(None)
    assert not progress.advanced
