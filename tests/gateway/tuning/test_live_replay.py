"""``replay --live``: prompts of exactly the traced token counts, played at the traced times
against a real gateway in front of simulated engines, measured as the replay's own tables; and
the window cut out of a long trace."""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any

import pytest

from engine_pool.sim.server import run_sim
from gateway.config_check import load_settings
from gateway.count.tokens import TokenCounter
from gateway.observe.trace import TraceRecord, synthesize, write_trace
from gateway.shipped import resolve_policy
from gateway.tools.cli import main
from gateway.tools.sim_support import RegistryCounter
from gateway.tuning import live_measure, live_replay, live_report
from gateway.tuning.fleet_model import LiveCosts
from gateway.tuning.live_cli import predict
from gateway.tuning.replay import percentile, summarize
from gateway.tuning.trace_window import busiest, cut
from tests.conftest import lanes_config

SCALE = 0.2


def _record(t: float, tokens: int, output: int = 8) -> TraceRecord:
    return TraceRecord(t, "qwen3.6", tokens, tokens * 4, output)


@pytest.mark.parametrize("tokens", [40, 200, 3001, 70_000])
def test_prompts_have_exactly_the_traced_token_count(counter: TokenCounter, tokens: int) -> None:
    builder = live_replay.PromptBuilder(counter, "qwen3.6")
    first, second = builder.build(0, tokens), builder.build(1, tokens)
    assert builder.count(first) == tokens == builder.count(second)
    assert first != second  # every prompt its own text: no cache makes it cheaper


def test_a_prompt_smaller_than_the_chat_template_is_refused(counter: TokenCounter) -> None:
    with pytest.raises(ValueError, match="exactly 3 tokens"):
        live_replay.PromptBuilder(counter, "qwen3.6").build(0, 3)


async def test_a_trace_played_live_is_measured_as_the_replay_measures(
    counter: TokenCounter, gateway_at: Any
) -> None:
    trace = [_record(0.1 * i, 300 + 200 * i) for i in range(8)] + [_record(0.35, 40_000, 4)]
    trace.sort(key=lambda r: r.t)
    builder = live_replay.PromptBuilder(counter, "qwen3.6")
    prompts = [builder.build(i, r.prompt_tokens) for i, r in enumerate(trace)]
    shared = RegistryCounter(counter, "qwen3.6")
    async with (
        run_sim("h100-fast", time_scale=SCALE, counter=shared) as fast,
        run_sim("h100-heavy", time_scale=SCALE, counter=shared) as heavy,
    ):
        config = lanes_config([fast.url], [heavy.url], threshold=32768)
        async with gateway_at(config) as (url, settings):
            seen: list[tuple[int, int, int]] = []
            plays = await live_replay.play(
                url, trace, prompts, SCALE, 60, lambda *a: seen.append(a)
            )
            records = await live_measure.fetch_engine_records([fast.url, heavy.url])
    assert seen and seen[-1][1:] == (len(trace), len(trace))  # progress heard to the end
    assert all(p.status == 200 and p.error is None for p in plays)
    # The target counted exactly the traced tokens: the prompts were built for its tokenizer.
    assert live_report.count_mismatches(plays) == 0
    assert all(p.target_prompt_tokens == p.record.prompt_tokens for p in plays)
    assert [p.lane for p in plays] == [
        "heavy" if r.prompt_tokens > 32768 else "fast" for r in trace
    ]
    # Sent at t x S (late only by the player's own lag), first token before the end.
    for item in plays:
        assert item.sent is not None and item.first_token is not None
        assert item.record.t * SCALE <= item.sent < item.record.t * SCALE + 0.5
        assert item.sent < item.first_token <= (item.finished or 0)
    lag = live_report.send_lag(plays)
    assert 0 <= lag["p50_ms"] <= lag["max_ms"] < 500
    # The same tables as --simulate, in engine seconds (wall / S).
    report = summarize("live", settings, live_replay.as_result(settings, plays, SCALE))
    small, large = report.summary["small_requests"], report.summary["large_requests"]
    assert small["requests"] == 8 and large["requests"] == 1 and small["rejected"] == 0
    heavy_play = next(p for p in plays if p.lane == "heavy")
    assert large["ttft_p50"] == pytest.approx(
        ((heavy_play.first_token or 0) - (heavy_play.sent or 0)) / SCALE
    )
    # The engines' records give the live path's costs.
    measured = live_measure.measure(plays, records, SCALE)
    assert measured is not None and measured.requests == len(trace)
    assert 0 < measured.pre_ms_p50 < 1000
    # The cost splits into the gateway's serial part and the hop's parallel one; a trace with
    # no burst gives the fit no reason to put any of it in the serial part, but never none at all.
    costs = measured.costs
    assert costs.time_scale == SCALE and costs.gateway_s >= 0 and costs.forward_s >= 0
    assert costs.gateway_s + costs.forward_s > 0


async def test_the_player_stops_at_its_deadline(counter: TokenCounter, gateway_at: Any) -> None:
    trace = [_record(0.0, 300, output=5000), _record(100.0, 300)]
    builder = live_replay.PromptBuilder(counter, "qwen3.6")
    prompts = [builder.build(i, r.prompt_tokens) for i, r in enumerate(trace)]
    shared = RegistryCounter(counter, "qwen3.6")
    async with run_sim("h100-fast", time_scale=1.0, counter=shared) as fast:
        config = lanes_config([fast.url], [fast.url], threshold=32768)
        async with gateway_at(config) as (url, settings):
            started = time.monotonic()
            plays = await live_replay.play(url, trace, prompts, 1.0, 1.0)
            took = time.monotonic() - started
    assert took < 5
    assert plays[0].error == "unfinished" and plays[1].error == "not_sent"
    result = live_replay.as_result(settings, plays, 1.0)
    assert [o.rejected for o in result.outcomes] == ["unfinished", "not_sent"]


def test_ratios_compare_every_percentile_and_name_the_worst() -> None:
    trace = [_record(float(i), 1000) for i in range(5)]
    settings = load_settings(resolve_policy("configs/demo.yaml"))
    base = predict("a", settings, trace, LiveCosts.none())
    slower = predict("b", settings, trace, LiveCosts(time_scale=0.01, gateway_s=0.01))
    found = live_report.ratios(slower, base)
    assert set(found) == {"small", "lane fast"}
    assert all(r > 1 for r in found["small"].values())
    assert live_report.worst_ratio(found) == max(found["small"].values())
    assert live_report.worst_ratio({"x": {"m": 0.5}}) == 2.0
    assert math.isnan(live_report.worst_ratio({}))


def test_a_window_is_cut_and_rebased_and_the_busiest_holds_the_monsters() -> None:
    trace = synthesize("production-burst", 1)
    start = busiest(trace, 300)
    window = cut(trace, start, 300)
    assert window[0].t >= 0 and window[-1].t < 300
    assert len(window) == sum(1 for r in trace if start <= r.t < start + 300)
    monsters = sum(1 for r in window if r.prompt_tokens >= 32768)
    # No other 300 s window that starts at a request holds more monsters.
    for other in trace[::25]:
        assert (
            sum(1 for r in trace if other.t <= r.t < other.t + 300 and r.prompt_tokens >= 32768)
            <= monsters
        )
    with pytest.raises(ValueError, match="no request"):
        cut(trace, 10**6, 10)


def test_the_cost_fit_recovers_a_gateway_that_serves_one_request_at_a_time() -> None:
    truth = LiveCosts(time_scale=1.0, gateway_s=0.006, forward_s=0.003, per_mtoken_s=0.0)
    # Two bursts of ten and a trickle: the bursts queue for the gateway, the trickle does not.
    sends = [(0.0, 500)] * 10 + [(1.0 + 0.3 * i, 500) for i in range(10)] + [(5.0, 500)] * 10
    delays = live_measure._modelled_pre(truth, sends)
    start = LiveCosts(time_scale=1.0, gateway_s=0, forward_s=0, per_mtoken_s=0.0)
    fitted = live_measure._fit_split(
        start, sends, statistics.median(delays), percentile(delays, 0.9)
    )
    assert fitted.gateway_s == pytest.approx(0.006, rel=0.1)
    assert fitted.forward_s == pytest.approx(0.003, rel=0.2)


def test_the_cli_refuses_what_it_cannot_play(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, [_record(0.0, 300)])
    config = "configs/demo.yaml"
    assert main(["replay", "--config", config, str(trace), "--time-scale", "0", "--simulate"]) == 2
    assert "--time-scale must be positive" in capsys.readouterr().err
    live = ["replay", "--config", config, str(trace), "--live", "http://127.0.0.1:9"]
    assert main([*live, "--compare", config, "--simulate"]) == 2
    assert "--live plays one policy" in capsys.readouterr().err
