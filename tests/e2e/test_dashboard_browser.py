"""End to end: headless chromium loads the ops dashboard while traffic flows through a real
gateway in front of four simulated vLLM engines, and sees the lanes, the engines, the events
and the decisions table fill in. The screenshot is kept as an artifact:
``bench-results/dashboard.png`` (or ``$SHAPEGATE_ARTIFACTS/dashboard.png``); with
``SHAPEGATE_DOCS_SCREENSHOT=1`` it is also written to ``docs/dashboard.png`` for the README.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_pool.sim.server import SimServer, run_sim
from gateway.count.tokens import TokenCounter
from gateway.tools.sim_support import RegistryCounter
from tests.conftest import ROOT, lanes_config
from tests.support.cdp import CHROMIUM, Page, chromium
from tests.support.fake_engine import FakeEngine
from tests.support.servers import serve_asgi

pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="Debian's chromium is not installed (apt-get install chromium; .ci/run installs it)",
)

WIDTH = 1600
DOCS = os.environ.get("SHAPEGATE_DOCS_SCREENSHOT") == "1"
# Seconds of traffic the charts gather before the screenshot: a longer story for the README.
HISTORY_S = 45.0 if DOCS else 3.0
WORDS = ("route", "the", "monster", "prompt", "to", "its", "own", "lane", "so", "small", "ones")
# Both lane cards show a request rate and TTFT samples.
LANES_FILLED = """(() => {
  const card = (name) => document.querySelector(`[data-lane=${name}]`);
  const samples = (c) => parseInt(c.querySelectorAll('.stat .sub')[2].textContent);
  const f = card('fast'), h = card('heavy');
  return f && h && parseFloat(f.querySelector('.lane-rate').textContent) > 1
    && samples(f) > 0 && samples(h) > 0;
})()"""


def policy(fast: list[str], heavy: list[str]) -> dict[str, Any]:
    config = lanes_config(fast, heavy, threshold=2000)
    health = {"interval_s": 0.5, "timeout_s": 2, "scrape_interval_s": 0.5}
    fast_lane, heavy_lane = config["lanes"]
    fast_lane["health"] = health
    heavy_lane["health"] = health
    # Few heavy slots, so the heavy lane visibly queues; a short idle deadline, so the stall
    # injected below becomes watchdog events.
    heavy_lane["slots"] = {"lane": 3, "per_endpoint": 2}
    heavy_lane["queue"] = {"depth": 32, "max_wait_s": 8}
    heavy_lane["timeouts"] = {"connect_s": 2, "first_byte_s": 5, "idle_s": 1.0, "total_s": 30}
    return config


@contextlib.asynccontextmanager
async def engines(counter: TokenCounter) -> AsyncIterator[list[SimServer]]:
    shared = RegistryCounter(counter, "qwen3.6")
    async with contextlib.AsyncExitStack() as stack:
        sims = []
        for profile, seed in (
            ("h100-fast", 1),
            ("h100-fast", 2),
            ("h100-heavy", 3),
            ("h100-heavy", 4),
        ):
            sims.append(
                await stack.enter_async_context(
                    run_sim(profile, time_scale=0.25, counter=shared, seed=seed)
                )
            )
        await sims[1].set_faults({"error_500_rate": 0.03})
        yield sims


def body(words: int, rng: random.Random, **extra: Any) -> dict[str, Any]:
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return {
        "model": "qwen3.6",
        "messages": [{"role": "user", "content": text}],
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


async def traffic(url: str, stop: asyncio.Event, sent: list[str]) -> None:
    """Mixed traffic: many short chats, a heavy prompt every ~0.5 s, a few bad or impatient."""
    rng = random.Random(7)
    async with httpx.AsyncClient(base_url=url, timeout=30, trust_env=False) as client:

        async def one(request_id: str, payload: dict[str, Any], read_s: float) -> None:
            sent.append(request_id)
            with contextlib.suppress(httpx.HTTPError):
                async with client.stream(
                    "POST",
                    "/v1/chat/completions",
                    json=payload,
                    headers={"x-request-id": request_id},
                    timeout=httpx.Timeout(30, read=read_s),
                ) as response:
                    async for _ in response.aiter_bytes():
                        pass

        tasks: set[asyncio.Task[None]] = set()
        for i in itertools.count():
            if stop.is_set():
                break
            if i % 12 == 5:
                payload = body(rng.randrange(6_000, 40_000), rng, max_tokens=24)
                request = one(f"e2e-heavy-{i}", payload, 0.25 if i % 60 == 17 else 30)
            elif i % 45 == 44:
                request = one(f"e2e-bad-{i}", {**body(8, rng), "model": "no-such-model"}, 30)
            else:
                payload = body(rng.randrange(5, 400), rng, max_tokens=rng.randrange(8, 48))
                request = one(f"e2e-fast-{i}", payload, 30)
            task = asyncio.create_task(request)
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            # Arrivals swell and ebb over ~50 s, as real traffic does.
            await asyncio.sleep(0.04 * (1 + 0.6 * math.sin(i / 60)))
        await asyncio.gather(*tasks)


@contextlib.asynccontextmanager
async def live_gateway(
    counter: TokenCounter, gateway_at: Any, sent: list[str]
) -> AsyncIterator[tuple[str, list[SimServer]]]:
    """Four simulated engines, a gateway in front, and traffic flowing until the block ends."""
    async with engines(counter) as sims:
        fast = [s.url for s in sims[:2]]
        heavy = [s.url for s in sims[2:]]
        async with gateway_at(policy(fast, heavy)) as (url, _settings):
            stop = asyncio.Event()
            load = asyncio.create_task(traffic(url, stop, sent))
            try:
                yield url, sims
            finally:
                stop.set()
                await asyncio.gather(load, return_exceptions=True)


async def incident(heavy: SimServer, seen: asyncio.Event) -> None:
    """One heavy engine stalls its streams until the page has listed a watchdog event (then
    again now and then): the idle deadline must end those requests, and the page show it."""
    stall = {"stall_after_tokens": 4, "stall_for_s": 3}
    await asyncio.sleep(2.0)
    await heavy.set_faults(stall)
    await seen.wait()
    await heavy.set_faults({})
    while True:
        await asyncio.sleep(25)
        await heavy.set_faults(stall)
        await asyncio.sleep(2.5)
        await heavy.set_faults({})


def artifact_dir() -> Path:
    return Path(os.environ.get("SHAPEGATE_ARTIFACTS") or ROOT / "bench-results")


FAILED_OUTCOMES = {"timeout", "upstream_error", "error"}


async def outcomes_shown(page: Page) -> list[str]:
    shown: list[str] = await page.evaluate(
        "[...document.querySelectorAll('#decisions tbody tr[data-id] td:nth-child(10)')]"
        ".map(td => td.textContent)"
    )
    return shown


async def visible_lanes(page: Page) -> list[str]:
    lanes: list[str] = await page.evaluate(
        "[...document.querySelectorAll('#decisions tbody tr td:nth-child(7)')]"
        ".map(td => td.textContent)"
    )
    return lanes


async def test_dashboard_fills_in_while_traffic_flows(
    counter: TokenCounter, gateway_at: Any
) -> None:
    sent: list[str] = []
    async with live_gateway(counter, gateway_at, sent) as (url, sims):
        listed = asyncio.Event()
        trouble = asyncio.create_task(incident(sims[3], listed))
        try:
            async with chromium(WIDTH, 1000) as page:
                await page.goto(url + "/dashboard")
                await page.wait_for("document.body.dataset.ready === 'true'")
                # The lanes fill in: both cards, a request rate, TTFT samples in each lane.
                await page.wait_for(LANES_FILLED)
                # Monsters overlap: the heavy lane's slot gauge shows at least two held.
                await page.wait_for(
                    "parseInt(document.querySelector('[data-lane=heavy] .stat .v')"
                    ".textContent) >= 2"
                )
                # The decisions table fills in with the requests we sent, by lane.
                await page.wait_for(
                    "document.querySelectorAll('#decisions tbody tr[data-id]').length >= 40"
                )
                shown = set(
                    await page.evaluate(
                        "[...document.querySelectorAll('#decisions tbody tr[data-id]')]"
                        ".map(tr => tr.dataset.id)"
                    )
                )
                assert shown <= set(sent)
                assert any(i.startswith("e2e-heavy-") for i in shown)
                assert any(i.startswith("e2e-fast-") for i in shown)
                # Engine load is read from the simulated engines' own /metrics.
                await page.wait_for(
                    "[...document.querySelectorAll('#engines tbody tr td:last-child')]"
                    ".filter(td => td.textContent !== 'never').length === 4"
                )
                # The stalled engine's requests hit the idle deadline: listed, not hidden.
                await page.wait_for(
                    "[...document.querySelectorAll('#events li .chip')]"
                    ".some(c => c.textContent === 'watchdog')"
                )
                listed.set()
                # Filtering by lane shows only that lane's decisions.
                await page.click("#f-lane button[data-value=heavy]")
                lanes = await visible_lanes(page)
                assert lanes and set(lanes) == {"heavy"}
                await page.click("#f-lane button[data-value=all]")
                assert set(await visible_lanes(page)) >= {"fast", "heavy"}
                every = await outcomes_shown(page)
                await page.click("#f-outcome button[data-value=failed]")
                failed = await outcomes_shown(page)
                # Only failures under that filter. A stalled stream mostly migrates to the other
                # heavy engine (issue 33) and ends ok, so failures are not certain: the filter
                # shows some whenever the table held some a moment earlier.
                assert set(failed) <= FAILED_OUTCOMES, failed
                assert bool(failed) or not FAILED_OUTCOMES & set(every), (every, failed)
                assert set(every) - FAILED_OUTCOMES, every  # and it did hide something
                await page.click("#f-outcome button[data-value=all]")
                # Let the charts gather a few points, then keep the picture.
                await asyncio.sleep(HISTORY_S)
                shot = await page.screenshot(artifact_dir() / "dashboard.png", WIDTH)
                print(f"dashboard screenshot: {shot}")
                if DOCS:
                    await page.screenshot(ROOT / "docs" / "dashboard.png", WIDTH)
                assert shot.stat().st_size > 50_000
                assert page.errors == []
        finally:
            trouble.cancel()
            await asyncio.gather(trouble, return_exceptions=True)


async def test_with_a_token_the_page_asks_for_it_and_reads_it_from_the_fragment(
    gateway_at: Any,
) -> None:
    token = "e2e-admin-token-0123456789"
    async with serve_asgi(FakeEngine()) as engine:
        config = lanes_config([engine], [engine])
        config["server"]["admin_token"] = token
        async with gateway_at(config) as (url, _settings), chromium(1200, 800) as page:
            await page.goto(url + "/dashboard")
            await page.wait_for("!document.getElementById('auth').hidden")
            why = await page.evaluate("document.getElementById('auth-why').textContent")
            assert why.startswith("401")
            # The fragment never reaches the server; the page keeps the token for the tab only.
            await page.goto(f"{url}/dashboard#token={token}")
            await page.wait_for("document.body.dataset.ready === 'true'")
            assert await page.evaluate("location.hash") == ""
            assert await page.evaluate("document.getElementById('auth').hidden")
            lanes = await page.evaluate(
                "[...document.querySelectorAll('.lane')].map(e => e.dataset.lane)"
            )
            assert lanes == ["fast", "heavy"]
            assert page.errors == []


# Everything inside a lane card stays inside it (no value spills out, no stat scrolls), the
# engines table needs no horizontal scroll, and neither does the page.
OVERFLOW = """(() => {
  const bad = [];
  const px = (r) => `${Math.round(r.left)}..${Math.round(r.right)}`;
  for (const card of document.querySelectorAll('.lane')) {
    const box = card.getBoundingClientRect();
    for (const el of card.querySelectorAll('*')) {
      const r = el.getBoundingClientRect();
      if (r.width && (r.right > box.right + 0.5 || r.left < box.left - 0.5)) {
        bad.push(`lane ${card.dataset.lane}: <${el.tagName.toLowerCase()} class="${el.className}">`
          + ` "${el.textContent.slice(0, 30)}" at ${px(r)} outside the card ${px(box)}`);
      }
    }
    for (const el of card.querySelectorAll('.stat, .stat .v, .lane-head, .chart-head')) {
      if (el.scrollWidth > el.clientWidth + 1) {
        bad.push(`lane ${card.dataset.lane}: .${el.className} holds ${el.scrollWidth}px in `
          + `${el.clientWidth}px`);
      }
    }
  }
  const engines = document.querySelector('#engines').closest('.scroll');
  if (engines.scrollWidth > engines.clientWidth + 1) {
    bad.push(`engines table is ${engines.scrollWidth}px wide in ${engines.clientWidth}px`);
  }
  const page = document.documentElement;
  if (page.scrollWidth > window.innerWidth) bad.push('the page scrolls sideways');
  return bad;
})()"""


@pytest.mark.parametrize("width", [1280, 1440])
async def test_dashboard_is_readable_without_horizontal_overflow(
    counter: TokenCounter, gateway_at: Any, width: int
) -> None:
    async with (
        live_gateway(counter, gateway_at, []) as (url, _sims),
        chromium(width, 900) as page,
    ):
        await page.goto(url + "/dashboard")
        await page.wait_for("document.body.dataset.ready === 'true'")
        await page.wait_for(LANES_FILLED)
        # Engines carry their load and a TTFT p95 once requests came back.
        await page.wait_for(
            "[...document.querySelectorAll('#engines tbody tr td:last-child')]"
            ".filter(td => td.textContent !== 'never').length === 4"
        )
        await page.wait_for(
            "[...document.querySelectorAll('#engines tbody tr td.ttft')]"
            ".filter(td => td.textContent !== '—').length >= 2"
        )
        await asyncio.sleep(2.0)  # a few more refreshes with data
        problems = await page.evaluate(OVERFLOW)
        await page.screenshot(artifact_dir() / f"dashboard-{width}.png", width)
        assert problems == []
        assert page.errors == []
        # The check sees an overflow when there is one (before the next refresh).
        seen = await page.evaluate(
            "(() => { document.querySelector('[data-lane=fast] .stat .v')"
            ".textContent = '9'.repeat(90);"
            " document.querySelector('#engines tbody td.mono')"
            ".textContent = 'x'.repeat(400); return " + OVERFLOW + "; })()"
        )
        assert any(p.startswith("lane fast") for p in seen), seen
        assert any(p.startswith("engines table") for p in seen), seen


async def test_a_misconfigured_engine_is_shown_with_its_evidence(
    counter: TokenCounter, gateway_at: Any
) -> None:
    """A lane admitting 131,072-token prompts in front of an engine of 32,768: the engines
    table shows the endpoint misconfigured (a warning chip) with both numbers, and the header
    counts it."""
    shared = RegistryCounter(counter, "qwen3.6")
    async with run_sim("h100-fast", time_scale=0.01, counter=shared) as sim:
        config = lanes_config([sim.url], [sim.url], threshold=2000)
        config["lanes"] = [config["lanes"][0]]
        config["lanes"][0]["max_prompt_tokens"] = 131_073
        config["lanes"][0]["health"] = {"interval_s": 0.5, "timeout_s": 2}
        config["clusters"] = [config["clusters"][0]]
        async with gateway_at(config) as (url, _), chromium(WIDTH, 1000) as page:
            await page.goto(url + "/dashboard")
            await page.wait_for("document.body.dataset.ready === 'true'")
            await page.wait_for(
                "[...document.querySelectorAll('#engines tbody .chip.warn')]"
                ".some(c => c.textContent === 'misconfigured')"
            )
            evidence = await page.evaluate(
                "document.querySelector('#engines tbody .evidence').textContent"
            )
            assert "131,072" in evidence and "32,768" in evidence, evidence
            pills = await page.evaluate("document.querySelector('#pills').textContent")
            assert "misconfigured1" in pills.replace(" ", ""), pills
            assert page.errors == []


async def test_a_shadow_policy_is_shown_with_its_disagreements(gateway_at: Any) -> None:
    """A shadow whose fast lane ends at 500 tokens beside the active 2,000: the panel appears
    with the requests compared and the fast -> heavy row of the prompts between."""
    fast, heavy = FakeEngine(), FakeEngine()
    async with serve_asgi(fast) as fast_url, serve_asgi(heavy) as heavy_url:
        config = lanes_config([fast_url], [heavy_url], threshold=2000)
        shadow = lanes_config([fast_url], [heavy_url], threshold=500)
        async with gateway_at(config) as (url, _), chromium(WIDTH, 1000) as page:
            async with httpx.AsyncClient(timeout=30) as client:
                started = await client.post(
                    url + "/admin/shadow",
                    json=shadow,
                    headers={"x-shapegate-admin": "1"},
                )
                assert started.status_code == 200, started.text
                for words in (50, 100, 800, 1200):
                    text = " ".join("lane" for _ in range(words))
                    body = {"model": "qwen3.6", "messages": [{"role": "user", "content": text}]}
                    answer = await client.post(url + "/v1/chat/completions", json=body)
                    assert answer.status_code == 200
            await page.goto(url + "/dashboard")
            await page.wait_for("document.body.dataset.ready === 'true'")
            await page.wait_for("!document.getElementById('shadow').hidden")
            await page.wait_for(
                "document.getElementById('shadow-sum').textContent.includes('compared 4')"
            )
            row = await page.evaluate(
                "[...document.querySelectorAll('#shadow-table tr.disagree td')]"
                ".map(td => td.textContent)"
            )
            assert row[:3] == ["fast", "heavy", "2"], row
            assert page.errors == []
