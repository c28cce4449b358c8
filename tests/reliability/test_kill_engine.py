"""``kill -9`` of one of two engines under load: only the requests in flight on it may fail.

Two simulated engines (processes of their own) serve one lane; six clients send requests in
loops, half of them streamed. One engine is killed with SIGKILL. A request that had not yet
received a byte from the killed engine fails over to the other one (gateway/request/failover.py);
one
whose answer had begun (a stream under way) fails with a clear error. No request started after
the kill fails: the dead engine always looks the least loaded (nothing stays in flight on it),
so without failover nearly every new request would meet its closed port until a probe noticed.
With the prober effectively off (a 60 s interval), passive ejection alone keeps it so.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.conftest import JSON, lanes_config
from tests.reliability.reliability_support import chat_body, held, settled, timed_logs
from tests.support.sim_process import sim_processes

CLIENTS = 6
BEFORE_KILL_S = 1.5
AFTER_KILL_S = 3.0


@dataclass(frozen=True)
class Call:
    rid: str
    stream: bool
    started: float
    ended: float
    status: int
    failed: bool
    detail: str


async def client_loop(
    client: httpx.AsyncClient, url: str, n: int, until: float, calls: list[Call]
) -> None:
    i = 0
    while time.time() < until:
        rid, stream = f"c{n}-{i}", (n + i) % 2 == 0
        i += 1
        started = time.time()
        body = chat_body(f"{rid} tell me a story", stream=stream, max_tokens=24)
        try:
            headers = {"x-request-id": rid, **JSON}
            async with client.stream(
                "POST", url + "/v1/chat/completions", content=body, headers=headers
            ) as r:
                payload = await r.aread()
            status = r.status_code
            failed = status != 200 or b'{"error"' in payload
            detail = payload[-300:].decode(errors="replace") if failed else ""
        except httpx.HTTPError as exc:
            status, failed, detail = 0, True, repr(exc)
        calls.append(Call(rid, stream, started, time.time(), status, failed, detail))


def final_endpoints(logs: list[Any]) -> dict[str, str]:
    """Where each request ended up: its admission's endpoint, or its last failover's."""
    where: dict[str, str] = {}
    for event in logs:
        if event["event"] == "route.decision":
            where[event["request_id"]] = event["endpoint"]
        elif event["event"] == "route.retry":
            where[event["request_id"]] = event["to"]
    return where


@pytest.mark.parametrize("probe_interval_s", [0.5, 60.0], ids=["prober", "passive-only"])
async def test_kill_9_fails_only_the_requests_in_flight_on_the_killed_engine(
    gateway_at: Any, probe_interval_s: float
) -> None:
    with sim_processes(2, time_scale=1.0) as sims:
        victim, survivor = sims
        config = lanes_config([victim.url, survivor.url], ["http://127.0.0.1:9"])
        config["lanes"][0]["health"] = {
            "interval_s": probe_interval_s,
            "timeout_s": 2,
            "up_after_successes": 2,
        }
        calls: list[Call] = []
        with timed_logs() as logs:
            async with gateway_at(config) as (url, _), httpx.AsyncClient(timeout=30) as client:
                start = time.time()
                until = start + BEFORE_KILL_S + AFTER_KILL_S
                loops = [
                    asyncio.create_task(client_loop(client, url, n, until, calls))
                    for n in range(CLIENTS)
                ]
                await asyncio.sleep(BEFORE_KILL_S)
                killed_at = victim.kill()
                await asyncio.gather(*loops)
                state = await settled(client, url)
                assert held(state) == 0, state

    where = final_endpoints(logs)
    before = [c for c in calls if c.started < killed_at]
    after = [c for c in calls if c.started >= killed_at]
    failed = [c for c in calls if c.failed]
    in_flight_on_victim = {
        c.rid for c in before if c.ended > killed_at and where.get(c.rid) == victim.url
    }
    print(
        f"\nprobe interval {probe_interval_s}s: {len(before)} requests before the kill "
        f"({sum(where.get(c.rid) == victim.url for c in before)} on the victim), "
        f"{len(after)} after; {len(in_flight_on_victim)} in flight on the victim at the kill; "
        f"{len(failed)} failed; retries {sum(e['event'] == 'route.retry' for e in logs)}"
    )
    assert len(after) >= 3 * CLIENTS, "too little load after the kill to show anything"
    assert any(where.get(c.rid) == victim.url for c in before), "the victim served nothing"
    assert [c for c in after if c.failed] == [], "a request started after the kill failed"
    for call in failed:
        assert call.rid in in_flight_on_victim, call
        assert call.stream, call  # only an answer under way is lost; the rest failed over
    assert all(where[c.rid] == survivor.url for c in after if c.rid in where)
    changes = [
        e for e in logs if e["event"] == "engine.state_changed" and e["endpoint"] == victim.url
    ]
    assert changes and changes[0]["new"] == "down", changes
    if probe_interval_s > 10:
        assert changes[0]["evidence"].startswith("ejected:"), changes[0]
