"""Real vLLM /metrics read by the gateway with no error swallowed, and the gateway's own /metrics
and admin state counting what the real engines served."""

from __future__ import annotations

import time

import httpx

from tests.real.engines import MODEL, Real
from tests.support.waiting import wait_for


def swallowed(real: Real) -> float:
    return real.gateway.metrics().value("shapegate_swallowed_errors_total")


async def test_real_metrics_are_parsed_with_no_swallowed_error(real: Real) -> None:
    before = swallowed(real)
    engine_metrics = {name: e.metrics() for name, e in real.engines.items()}
    for name, scrape in engine_metrics.items():
        # The names the gateway's load scraper reads, as this vLLM release exposes them.
        for series in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            assert scrape.has(series, model_name=MODEL), (name, series)
        assert scrape.has("vllm:kv_cache_usage_perc", model_name=MODEL), name
        # The process start time the monitor reads as a restart when it changes
        # (engine_pool/load.py ``started_s``): exported, a recent date, steady while it lives.
        started = scrape.value("process_start_time_seconds")
        assert scrape.has("process_start_time_seconds"), name
        assert 0 < time.time() - started < 86_400, (name, started)
        assert real.engines[name].metrics().value("process_start_time_seconds") == started
    async with httpx.AsyncClient(timeout=60) as client:
        for stream in (False, True):
            answer = await client.post(
                real.gateway.url + "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "hello"}],
                    "max_tokens": 4,
                    "stream": stream,
                },
            )
            assert answer.status_code == 200
        # Several scrape rounds of both engines (every 0.5 s in the tier's policy).
        state_before = real.gateway.state()

        def scraped_again() -> bool:
            now = real.gateway.state()
            ages = [e["load_age_s"] for c in now["clusters"] for e in c["endpoints"]]
            return all(a is not None and a < 1.5 for a in ages) and now != state_before

        await wait_for(scraped_again, 10, interval=0.5, what="fresh scrapes of both engines")
    scrape = real.gateway.metrics()
    assert scrape.value("shapegate_swallowed_errors_total") == before, (
        "errors swallowed while reading real vLLM:\n"
        + "\n".join(str(e) for e in real.gateway.events("error.swallowed"))
    )
    assert scrape.value("shapegate_requests_total", lane="fast") >= 2
    assert scrape.value("shapegate_engine_up") == 2
    assert scrape.value("shapegate_prompt_tokens_count", lane="fast") >= 2
    assert scrape.value("shapegate_output_tokens_count", lane="fast", source="usage") >= 2
    # Steady start times over several scrapes: no restart seen where there was none.
    assert scrape.value("shapegate_engine_restarts_total") == 0


def test_the_admin_state_holds_no_slot_when_idle(real: Real) -> None:
    state = real.gateway.state()
    assert state["in_flight"] == 0
    assert all(lane["slots_in_use"] == 0 for lane in state["lanes"]), state["lanes"]
