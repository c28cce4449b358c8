"""The capability gate against real simulated engines (``shapegate sim`` processes): a lane that
admits more than its engine's own context is caught within one probe interval, prompts the
engine cannot hold never reach it, prompts it can hold still do."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from tests.conftest import MODEL
from tests.support.prom import parse
from tests.support.sim_process import SimProcess
from tests.support.waiting import wait_for

INTERVAL_S = 1.0
HEALTH = {"interval_s": INTERVAL_S, "timeout_s": 2.0, "scrape_interval_s": 0.5}
TIMEOUTS = {"connect_s": 2, "first_byte_s": 30, "idle_s": 30, "total_s": 60}


def running(profile: str) -> Iterator[SimProcess]:
    """``shapegate sim --profile PROFILE``, healthy, stopped afterwards."""
    sim = SimProcess(profile, time_scale=0.01)
    try:
        sim.wait_healthy()
        yield sim
    finally:
        sim.stop()


@pytest.fixture(scope="module")
def short_engine() -> Iterator[SimProcess]:
    """An engine started with max_model_len 32,768 (h100-fast)."""
    yield from running("h100-fast")


@pytest.fixture(scope="module")
def long_engine() -> Iterator[SimProcess]:
    """An engine with max_model_len 1,048,576 (h100-heavy)."""
    yield from running("h100-heavy")


def policy(endpoints: list[str]) -> dict[str, Any]:
    """One lane admitting prompts of up to 131,072 tokens in front of ``endpoints``."""
    return {
        "server": {"boot_probe": True},
        "models": [MODEL],
        "clusters": [{"name": "big", "endpoints": endpoints}],
        "lanes": [
            {
                "name": "big",
                "max_prompt_tokens": 131_073,
                "clusters": ["big"],
                "slots": {"lane": 8, "per_endpoint": 4},
                "health": HEALTH,
                "timeouts": TIMEOUTS,
            }
        ],
    }


def prompt(tokens: int) -> dict[str, Any]:
    # " hello" is one token of the Qwen3.6 vocabulary: the prompt is about `tokens` long.
    text = "hello" + " hello" * (tokens - 1)
    return {"model": "qwen3.6", "messages": [{"role": "user", "content": text}], "max_tokens": 4}


def engine_requests(sim: SimProcess) -> float:
    """The engine's own count of chat requests it received (http_requests_total)."""
    scrape = parse(httpx.get(sim.url + "/metrics", timeout=5).text)
    return scrape.value("http_requests_total", handler="/v1/chat/completions")


async def endpoint_of(client: httpx.AsyncClient, url: str, endpoint: str) -> dict[str, Any]:
    state = (await client.get(url + "/admin/state")).json()
    (found,) = [e for c in state["clusters"] for e in c["endpoints"] if e["url"] == endpoint]
    return dict(found)


async def test_an_engine_short_of_its_lane_is_misconfigured_and_kept_from_long_prompts(
    gateway_at: Any, short_engine: SimProcess
) -> None:
    models = httpx.get(short_engine.url + "/v1/models", timeout=5).json()
    assert models["data"][0]["max_model_len"] == 32_768  # what the engine itself reports
    with capture_logs() as logs:
        started = time.monotonic()
        async with (
            gateway_at(policy([short_engine.url])) as (url, _),
            httpx.AsyncClient(timeout=60) as client,
        ):

            async def misconfigured() -> bool:
                found = await endpoint_of(client, url, short_engine.url)
                return found["state"] == "misconfigured"

            await wait_for(misconfigured, INTERVAL_S, what="misconfigured within one interval")
            seen_after = time.monotonic() - started
            endpoint = await endpoint_of(client, url, short_engine.url)
            assert "131,072" in endpoint["evidence"] and "32,768" in endpoint["evidence"]
            assert endpoint["max_model_len"] == 32_768
            # Metric, /readyz and the boot probe name it; the lane still serves.
            metrics = parse((await client.get(url + "/metrics")).text)
            labels = {"cluster": "big", "endpoint": short_engine.url}
            assert metrics.value("shapegate_engine_misconfigured", **labels) == 1
            assert metrics.value("shapegate_engine_misconfigurations_total", **labels) == 1

            async def ready_now() -> bool:
                return (await client.get(url + "/readyz")).status_code == 200

            await wait_for(ready_now, 10, what="/readyz answers 200")
            ready = (await client.get(url + "/readyz")).json()
            assert ready["lanes"]["big"]["misconfigured"] == [short_engine.url]
            shown = ready["lanes"]["big"]["clusters"]["big"]["endpoints"][short_engine.url]
            assert shown.startswith("misconfigured: ") and "32,768" in shown
            admin = {"x-shapegate-admin": "1"}
            probe = (await client.post(url + "/admin/probe", headers=admin)).json()["lanes"]["big"]
            assert probe["passed"] and f"{short_engine.url} misconfigured" in probe["detail"]

            # 60,000 tokens: a clear 400 from the gateway, the engine never sees it.
            before = engine_requests(short_engine)
            refused = await client.post(url + "/v1/chat/completions", json=prompt(60_000))
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["code"] == 400 and error["param"] == "input_tokens"
            assert "maximum context length is 32768 tokens" in error["message"]
            assert short_engine.url in error["message"]
            assert refused.headers.get("x-shapegate-lane") in (None, "big")
            assert engine_requests(short_engine) == before

            # 1,000 tokens: still served by that engine.
            served = await client.post(url + "/v1/chat/completions", json=prompt(1_000))
            assert served.status_code == 200, served.text
            assert engine_requests(short_engine) == before + 1
    changes = [
        e for e in logs if e["event"] == "engine.state_changed" and e.get("new") == "misconfigured"
    ]
    assert len(changes) == 1 and "32,768" in changes[0]["evidence"], changes
    boot = next(e for e in logs if e["event"] == "lane.probed")  # the boot probe's verdict
    assert boot["passed"] and f"{short_engine.url} misconfigured" in boot["detail"], boot
    print(f"misconfigured {seen_after:.2f}s after the gateway started (interval {INTERVAL_S}s)")


async def test_a_prompt_one_engine_cannot_hold_goes_to_one_that_can(
    gateway_at: Any, short_engine: SimProcess, long_engine: SimProcess
) -> None:
    config = policy([short_engine.url, long_engine.url])
    async with gateway_at(config) as (url, _), httpx.AsyncClient(timeout=60) as client:

        async def read() -> bool:
            found = await endpoint_of(client, url, long_engine.url)
            return found["max_model_len"] == 1_048_576

        await wait_for(read, 5, what="both engines' capability read")

        async def ready_now() -> bool:  # the boot probe's ping is behind us
            return (await client.get(url + "/readyz")).status_code == 200

        await wait_for(ready_now, 10, what="/readyz answers 200")
        assert (await endpoint_of(client, url, long_engine.url))["state"] == "up"
        short_before, long_before = engine_requests(short_engine), engine_requests(long_engine)
        for _ in range(3):  # least loaded first would alternate: the short engine is never tried
            answer = await client.post(url + "/v1/chat/completions", json=prompt(60_000))
            assert answer.status_code == 200, answer.text
        assert engine_requests(short_engine) == short_before
        assert engine_requests(long_engine) == long_before + 3


async def test_a_reload_keeps_the_verdict_and_a_fitting_lane_clears_it(
    gateway_at: Any, short_engine: SimProcess
) -> None:
    config = policy([short_engine.url])
    config["server"] = {"boot_probe": False}
    admin = {"x-shapegate-admin": "1", "content-type": "application/json"}
    labels = {"cluster": "big", "endpoint": short_engine.url}
    with capture_logs() as logs:
        async with gateway_at(config) as (url, _), httpx.AsyncClient(timeout=60) as client:

            async def state_is(want: str) -> bool:
                return (await endpoint_of(client, url, short_engine.url))["state"] == want

            async def gauge() -> float:
                scrape = parse((await client.get(url + "/metrics")).text)
                return scrape.value("shapegate_engine_misconfigured", **labels)

            await wait_for(lambda: state_is("misconfigured"), INTERVAL_S)
            # The same policy again: the endpoint's record stays, and so does its gauge.
            same = await client.post(url + "/admin/reload", json=config, headers=admin)
            assert same.status_code == 200, same.text
            assert await state_is("misconfigured") and await gauge() == 1
            # A lane the engine holds (32,767-token prompts plus 1): fine within an interval.
            config["lanes"][0]["max_prompt_tokens"] = 32_768
            fits = await client.post(url + "/admin/reload", json=config, headers=admin)
            assert fits.status_code == 200, fits.text
            await wait_for(lambda: state_is("up"), INTERVAL_S + 0.5, what="up again")
            assert await gauge() == 0
    back = [e for e in logs if e["event"] == "engine.state_changed" and e.get("new") == "up"]
    assert back and back[0]["old"] == "misconfigured", back


async def test_a_batch_needs_room_for_its_longest_prompt_not_for_the_sum(
    gateway_at: Any, short_engine: SimProcess
) -> None:
    """Each prompt of a batch is its own sequence in the engine: two 20,000-token prompts (40,000
    in all, past the engine's 32,768) fit it, one 40,000-token prompt does not."""
    text = "hello" + " hello" * 19_999
    async with (
        gateway_at(policy([short_engine.url])) as (url, _),
        httpx.AsyncClient(timeout=60) as client,
    ):

        async def misconfigured() -> bool:
            found = await endpoint_of(client, url, short_engine.url)
            return found["state"] == "misconfigured"

        await wait_for(misconfigured, 5, what="the engine's capability read")
        batch = {"model": "qwen3.6", "prompt": [text, text], "max_tokens": 4}
        served = await client.post(url + "/v1/completions", json=batch)
        assert served.status_code == 200, served.text
        assert int(served.headers["x-shapegate-prompt-tokens"]) == 40_000
        assert served.json()["usage"]["prompt_tokens"] == 40_000
        whole = {"model": "qwen3.6", "prompt": text + text, "max_tokens": 4}
        refused = await client.post(url + "/v1/completions", json=whole)
        assert refused.status_code == 400, refused.text
        assert "maximum context length is 32768 tokens" in refused.json()["error"]["message"]
