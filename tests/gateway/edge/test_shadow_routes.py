"""``/admin/shadow`` with ``serve --workers 2`` (gateway/edge/shadow_routes.py): a start, stop
and promote reach every worker, each worker decides on its own traffic, and the report and the
metric count the whole gateway."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import yaml

from tests.conftest import ADMIN, JSON, lanes_config
from tests.integration.test_workers import serve_workers
from tests.support.fake_engine import FakeEngine
from tests.support.prom import parse
from tests.support.servers import serve_asgi

REQUESTS = 40


def body(words: int) -> dict[str, object]:
    text = " ".join("lane" for _ in range(words))
    return {"model": "qwen3.6", "messages": [{"role": "user", "content": text}], "max_tokens": 4}


async def one(url: str, words: int) -> httpx.Response:
    # A connection of its own: the kernel spreads new connections over the workers.
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.post(url + "/v1/chat/completions", json=body(words), headers=JSON)


async def test_every_worker_shadows_its_own_traffic_and_the_report_merges_them(
    tmp_path: Path,
) -> None:
    fake = FakeEngine()
    async with serve_asgi(fake) as engine_url:
        config = lanes_config([engine_url], [engine_url], threshold=4000)
        config["server"] = {"boot_probe": False}
        shadow = lanes_config([engine_url], [engine_url], threshold=1000)
        async with serve_workers(tmp_path, config) as served:
            url = served.url
            async with httpx.AsyncClient(timeout=30) as admin:
                started = await admin.post(
                    url + "/admin/shadow", content=yaml.safe_dump(shadow), headers=ADMIN
                )
                sizes = [200 if i % 4 else 2000 for i in range(REQUESTS)]
                answers = await asyncio.gather(*(one(url, n) for n in sizes))
                report = (await admin.get(url + "/admin/shadow")).json()
                # Each worker's own report, told apart by when its shadow started.
                own: dict[float, int] = {}
                for _ in range(200):  # until both answered (the kernel picks the worker)
                    if len(own) == 2:
                        break
                    async with httpx.AsyncClient(timeout=30) as fresh:
                        mine = await fresh.get(
                            url + "/admin/shadow", headers={"x-shapegate-scope": "worker"}
                        )
                    own[mine.json()["since"]] = mine.json()["compared"]
                metrics = (await admin.get(url + "/metrics")).text
                promoted = await admin.post(url + "/admin/shadow/promote", headers=ADMIN)
                state = (await admin.get(url + "/admin/state")).json()
                stopped = await admin.delete(url + "/admin/shadow", headers=ADMIN)
    assert started.status_code == 200, started.text
    assert started.json()["workers"] == {"applied": 2, "failed": []}
    assert all(a.status_code == 200 for a in answers)
    moved = sum(1 for n in sizes if n == 2000)
    assert report["compared"] == REQUESTS
    assert len(own) == 2 and sum(own.values()) == REQUESTS and min(own.values()) > 0
    assert report["disagreements"][0]["requests"] == moved
    assert report["agreed_by_lane"] == {"fast": REQUESTS - moved}
    scrape = parse(metrics)
    assert scrape.value("shapegate_shadow_decisions_total") == REQUESTS
    assert scrape.value("shapegate_shadow_decisions_total", shadow_lane="heavy") == moved
    assert len(fake.seen) == REQUESTS
    assert promoted.json()["workers"] == {"applied": 2, "failed": []}
    assert {w["policy_version"] for w in state["workers"]} == {2}
    assert stopped.json()["workers"] == {"applied": 2, "failed": []}
