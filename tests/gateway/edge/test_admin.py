"""The dashboard's JSON state says what an operator needs, and only admins can read it."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import httpx
import pytest

from engine_pool.sim.server import SimServer
from gateway.count.tokens import TokenCounter
from gateway.edge.admin.state import StoreWatch, build_state
from gateway.edge.app import create_app
from gateway.edge.services import Gateway
from gateway.errors import StateUnavailable
from gateway.settings import ConfigError, parse_settings
from gateway.slots.store import MemorySlotStore
from tests.conftest import chat, lanes_config
from tests.support.fake_engine import FakeEngine
from tests.support.servers import free_port, serve_asgi
from tests.support.waiting import wait_for

TOKEN = "s3cret-admin-token-0123456789"
REMOTE = ("192.0.2.7", 40000)


async def until(check: Callable[[], Awaitable[Any]], timeout_s: float = 10.0) -> Any:
    async with asyncio.timeout(timeout_s):
        while not (result := await check()):
            await asyncio.sleep(0.05)
        return result


async def state(client: httpx.AsyncClient) -> dict[str, Any]:
    response = await client.get("/admin/dashboard.json")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    data: dict[str, Any] = response.json()
    return data


def lane(data: dict[str, Any], name: str) -> dict[str, Any]:
    return next(entry for entry in data["lanes"] if entry["name"] == name)


async def test_state_shows_held_slots_in_flight_rows_then_rates_and_percentiles(
    sims: tuple[SimServer, SimServer], gateway_at: Any
) -> None:
    fast, heavy = sims
    config = lanes_config([fast.url], [heavy.url])
    config["lanes"][0]["slots"] = {"lane": 2, "per_endpoint": 2}
    await fast.set_faults({"first_byte_delay_s": 0.8})
    async with (
        gateway_at(config) as (url, _),
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        held = [
            asyncio.create_task(
                client.post(
                    "/v1/chat/completions",
                    json=chat(f"hold {i}", max_tokens=4),
                    headers={"x-request-id": f"held-{i}"},
                )
            )
            for i in range(3)
        ]

        async def while_held() -> dict[str, Any] | None:
            data = await state(client)
            fast_lane = lane(data, "fast")
            ok = fast_lane["slots_in_use"] == 2 and fast_lane["queue_depth"] == 1
            return data if ok else None

        during = await until(while_held)
        await asyncio.gather(*held)
        await fast.set_faults({})
        for i in range(12):
            r = await client.post(
                "/v1/chat/completions",
                json=chat(f"quick {i}", max_tokens=3, stream=True),
                headers={"x-request-id": f"quick-{i}"},
            )
            assert r.status_code == 200
        r = await client.post(
            "/v1/chat/completions",
            json=chat("monster " * 3000, max_tokens=3),
            headers={"x-request-id": "monster-1"},
        )
        assert r.status_code == 200
        after = await until(
            lambda: _finished(client, {"monster-1", *(f"quick-{i}" for i in range(12))})
        )

    fast_lane = lane(during, "fast")
    assert fast_lane["slot_limit"] == 2 and fast_lane["queue_limit"] == 512
    assert fast_lane["oldest_wait_s"] > 0
    assert fast_lane["clusters"] == [
        {"name": "fast", "emergency": False, "slots_in_use": 2.0, "slot_limit": 2.0}
    ]
    rows = {row["request_id"]: row for row in during["decisions"]}
    in_flight = [rows[f"held-{i}"] for i in range(3) if rows[f"held-{i}"]["outcome"] == "in_flight"]
    assert len(in_flight) >= 2
    assert all(row["age_s"] > 0 and row["duration_s"] is None for row in in_flight)
    endpoint = during["clusters"][0]["endpoints"][0]
    assert endpoint["url"] == fast.url and endpoint["in_flight"] == 2

    rows = {row["request_id"]: row for row in after["decisions"]}
    assert after["decisions"][0]["request_id"] == "monster-1"  # newest first
    monster = rows["monster-1"]
    assert monster["lane"] == "heavy" and monster["cluster"] == "heavy"
    assert monster["count_method"] == "exact" and monster["reason"] == "in_range"
    assert monster["prompt_tokens"] > 3000 and monster["body_bytes"] > 3000 * 8
    assert monster["outcome"] == "ok" and monster["status"] == 200
    quick = rows["quick-0"]
    assert quick["lane"] == "fast" and quick["count_method"] == "bound"
    assert quick["ttft_s"] is not None and quick["duration_s"] >= quick["ttft_s"]

    fast_lane = lane(after, "fast")
    assert fast_lane["slots_in_use"] == 0 and fast_lane["queue_depth"] == 0
    assert fast_lane["outcomes"] == {"ok": 15}
    assert fast_lane["rate_rps"] > 0
    # The window's percentiles agree with the requests it saw (bins are 4% wide).
    ttfts = [r["ttft_s"] for r in after["decisions"] if r["lane"] == "fast"]
    assert fast_lane["ttft"]["n"] == 15
    assert fast_lane["ttft"]["p50"] == pytest.approx(statistics.median_low(ttfts), rel=0.05)
    assert fast_lane["ttft"]["p99"] == pytest.approx(max(ttfts), rel=0.05)
    assert lane(after, "heavy")["e2e"]["n"] == 1
    series = fast_lane["series"]
    # 10 min of closed 2 s buckets, oldest first, as offsets from now.
    assert len(series["rate"]) == len(series["ttft_p50"]) == len(fast_lane["series_t"]) == 299
    assert fast_lane["series_t"][0] < fast_lane["series_t"][-1] <= 0


async def _finished(client: httpx.AsyncClient, ids: set[str]) -> dict[str, Any] | None:
    data = await state(client)
    done = {r["request_id"] for r in data["decisions"] if r["outcome"] == "ok"}
    return data if ids <= done else None


async def test_down_engine_deadlines_and_swallowed_errors_are_listed(gateway_at: Any) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: refused at once
    alive = FakeEngine()
    alive.metrics_status = 404  # answers probes, not /metrics: that scrape failure is unexpected
    async with serve_asgi(alive) as engine:
        config = lanes_config([engine], [dead])
        fast_lane, heavy_lane = config["lanes"]
        fast_lane["timeouts"] = {"connect_s": 1, "first_byte_s": 0.3, "idle_s": 5, "total_s": 9}
        quick = {"interval_s": 0.1, "timeout_s": 1, "scrape_interval_s": 0.1}
        fast_lane["health"] = heavy_lane["health"] = quick
        async with (
            gateway_at(config) as (url, _),
            httpx.AsyncClient(base_url=url, timeout=30) as client,
        ):
            r = await client.post(
                "/v1/chat/completions",
                # Streamed: its wait for the first byte is first_byte_s (a non-streamed one
                # waits for the whole answer, under total_s).
                json=chat("x", stream=True, fake={"mode": "hang"}),
                headers={"x-request-id": "hangs-1"},
            )
            assert r.status_code == 504

            async def listed() -> dict[str, Any] | None:
                data = await state(client)
                heavy = data["clusters"][1]["endpoints"][0]
                kinds = {e["kind"] for e in data["events"]}
                ok = heavy["state"] == "down" and kinds == {"watchdog", "swallowed"}
                return data if ok else None

            data = await until(listed)
    heavy = data["clusters"][1]["endpoints"][0]
    assert heavy["url"] == dead and heavy["evidence"]
    watchdog = next(e for e in data["events"] if e["kind"] == "watchdog")
    assert watchdog["where"] == "pipeline.deadline"
    assert watchdog["fields"]["request_id"] == "hangs-1"
    assert watchdog["fields"]["deadline"] == "first_byte"
    assert watchdog["fields"]["lane"] == "fast"
    assert "first byte deadline" in watchdog["message"]
    swallowed = next(e for e in data["events"] if e["kind"] == "swallowed")
    assert swallowed["where"] == "load.scrape"
    assert swallowed["decision"] == "route_without_load"
    assert swallowed["fields"]["endpoint"] == engine
    # The dead engine's failed checks are its own news, not swallowed errors.
    assert all(e["fields"].get("endpoint") != dead for e in data["events"])
    assert data["totals"]["watchdog"]["first_byte"] == 1
    assert data["totals"]["swallowed"]["load.scrape"] >= 1
    row = next(r for r in data["decisions"] if r["request_id"] == "hangs-1")
    assert row["outcome"] == "timeout" and row["deadline"] == "first_byte"


async def test_state_is_rebuilt_at_a_bounded_rate(gateway_at: Any) -> None:
    async with (
        serve_asgi(FakeEngine()) as engine,
        gateway_at(lanes_config([engine], [engine])) as (url, _),
        httpx.AsyncClient(base_url=url) as client,
    ):
        burst = await asyncio.gather(*(state(client) for _ in range(30)))
        newest = max(data["generated_at"] for data in burst)

        async def rebuilt() -> bool:
            return bool((await state(client))["generated_at"] > newest)

        await wait_for(rebuilt, 3, interval=0.05, what="a newer state")
    assert len({data["generated_at"] for data in burst}) <= 2


# ---- the admin guard ----


def app_with(environ: dict[str, str], counter: TokenCounter) -> Any:
    settings = parse_settings(lanes_config(["http://127.0.0.1:9"], ["http://127.0.0.1:9"]), environ)
    return create_app(settings, counter)


def client_for(app: Any, host: str) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, client=(host, 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000")


ADMIN = ("/admin/state", "/admin/dashboard.json", "/dashboard", "/dashboard/static/app.js")


async def test_without_a_token_admin_answers_loopback_only(counter: TokenCounter) -> None:
    app = app_with({}, counter)
    for host in ("127.0.0.1", "::1", "::ffff:127.0.0.1"):
        async with client_for(app, host) as local:
            for path in ADMIN:
                assert (await local.get(path)).status_code == 200, (host, path)
    async with client_for(app, REMOTE[0]) as remote:
        for path in ADMIN:
            refused = await remote.get(path)
            assert refused.status_code == 403, path
            assert refused.json()["error"]["type"] == "permission_error"
            assert refused.json()["error"]["code"] == 403
        assert (await remote.post("/admin/probe")).status_code == 403
        # Not admin: Prometheus and clients are unaffected.
        assert (await remote.get("/metrics")).status_code == 200
        assert (await remote.get("/v1/models")).status_code == 200
        assert (await remote.get("/administrators")).status_code == 404


async def test_with_a_token_admin_needs_the_bearer_token(counter: TokenCounter) -> None:
    app = app_with({"SHAPEGATE_SERVER__ADMIN_TOKEN": TOKEN}, counter)
    for host in (REMOTE[0], "127.0.0.1"):
        async with client_for(app, host) as client:
            for headers in (
                {},
                {"authorization": "Bearer wrong-token-wrong-token"},
                {"authorization": f"Basic {TOKEN}"},
                {"authorization": f"Bearer {TOKEN}x"},
            ):
                denied = await client.get("/admin/dashboard.json", headers=headers)
                assert denied.status_code == 401, headers
                assert denied.headers["www-authenticate"].startswith("Bearer")
                body = denied.json()["error"]
                assert body["type"] == "authentication_error" and body["code"] == 401
                assert TOKEN not in denied.text
            good = {"authorization": f"Bearer {TOKEN}"}
            assert (await client.get("/admin/dashboard.json", headers=good)).status_code == 200
            assert (await client.get("/admin/state", headers=good)).status_code == 200
            # The page itself holds no data; it reads the token from its URL fragment.
            page = await client.get("/dashboard")
            assert page.status_code == 200
            assert "default-src 'none'" in page.headers["content-security-policy"]


async def test_a_policy_reload_rotates_the_token_and_bumps_the_version(
    counter: TokenCounter,
) -> None:
    app = app_with({"SHAPEGATE_SERVER__ADMIN_TOKEN": TOKEN}, counter)
    rotated = "rotated-admin-token-9876543210"
    policy = lanes_config(["http://127.0.0.1:9"], ["http://127.0.0.1:9"])
    policy["server"]["admin_token"] = rotated
    old, new = {"authorization": f"Bearer {TOKEN}"}, {"authorization": f"Bearer {rotated}"}
    async with client_for(app, REMOTE[0]) as client:
        assert (await client.post("/admin/reload", json=policy)).status_code == 401
        assert (await client.post("/admin/reload", json=policy, headers=old)).status_code == 200
        assert (await client.get("/admin/dashboard.json", headers=old)).status_code == 401
        data = await client.get("/admin/dashboard.json", headers=new)
    assert data.status_code == 200 and data.json()["policy_version"] == 2
    assert rotated not in data.text


def test_admin_token_is_validated_and_never_printed() -> None:
    config = lanes_config(["http://a"], ["http://b"])
    with pytest.raises(ConfigError, match="admin_token"):
        parse_settings(config, {"SHAPEGATE_SERVER__ADMIN_TOKEN": "short"})
    settings = parse_settings(config, {"SHAPEGATE_SERVER__ADMIN_TOKEN": TOKEN})
    assert settings.server.admin_token is not None
    assert settings.server.admin_token.get_secret_value() == TOKEN
    assert TOKEN not in repr(settings) and TOKEN not in str(settings.model_dump())


async def test_dashboard_page_and_assets_are_served_from_memory(counter: TokenCounter) -> None:
    async with client_for(app_with({}, counter), "127.0.0.1") as client:
        page = await client.get("/dashboard")
        script = await client.get("/dashboard/static/app.js")
        style = await client.get("/dashboard/static/style.css")
        missing = await client.get("/dashboard/static/nope.js")
        escape = await client.get("/dashboard/static/..%2F__init__.py")
    assert page.headers["content-type"].startswith("text/html")
    assert 'src="dashboard/static/app.js"' in page.text
    assert script.headers["content-type"].startswith("text/javascript")
    assert "admin/dashboard.json" in script.text
    # Request ids and model names come from clients: the page never parses them as HTML.
    assert ".innerHTML" not in script.text and "insertAdjacentHTML" not in script.text
    assert style.headers["content-type"].startswith("text/css")
    assert missing.status_code == 404 and escape.status_code == 404
    # Air-gapped: the page loads nothing from another origin.
    for text in (page.text, script.text, style.text):
        assert "http://" not in text and "https://" not in text and "//cdn" not in text


class FlakyStore(MemorySlotStore):
    """A slot store whose shared state can be made unreachable, as Redis can."""

    down = False

    async def in_use(self, keys: Sequence[str]) -> dict[str, int]:
        if self.down:
            raise StateUnavailable("the shared slot store (Redis) is unreachable")
        return await super().in_use(keys)


async def test_an_unreachable_slot_store_shows_unknown_slots_and_is_reported_once(
    counter: TokenCounter,
) -> None:
    settings = parse_settings(lanes_config(["http://127.0.0.1:9"], ["http://127.0.0.1:9"]), {})
    gateway = Gateway.build(settings, counter)
    gateway.store = FlakyStore()
    watch = StoreWatch()
    assert lane(await build_state(gateway, watch), "fast")["slots_in_use"] == 0
    gateway.store.down = True
    outage = [await build_state(gateway, watch) for _ in range(3)]
    assert all(lane(s, "fast")["slots_in_use"] is None for s in outage)
    assert all(not s["slots_known"] for s in outage)
    assert outage[-1]["totals"]["swallowed"] == {"dashboard.state": 1.0}
    [event] = outage[-1]["events"]
    assert event["decision"] == "slots_shown_unknown" and "unreachable" in event["message"]
    gateway.store.down = False
    back = await build_state(gateway, watch)
    assert back["slots_known"] and lane(back, "fast")["slots_in_use"] == 0


def test_admin_access_is_a_pure_decision_over_the_request() -> None:
    from gateway.edge.admin.guard import AdminRequest, admin_access

    local = {"client_host": "127.0.0.1", "host": "127.0.0.1:8000"}
    assert admin_access(AdminRequest("/admin/state", **local), None).allow
    assert admin_access(
        AdminRequest("/admin/state", host="localhost:8000", client_host="::1"), None
    ).allow
    # Writes need the non-simple header (or the token); reads do not.
    write = AdminRequest("/admin/reload", method="POST", **local)
    assert admin_access(write, None).status == 403
    assert admin_access(
        AdminRequest("/admin/reload", "POST", admin_header=True, **local), None
    ).allow
    # Cross-site signals, a rebound Host, an opaque origin: refused in loopback mode...
    for req in (
        AdminRequest("/admin/state", sec_fetch_site="cross-site", **local),
        AdminRequest("/admin/state", sec_fetch_site="same-site", **local),
        AdminRequest("/admin/state", origin="http://evil.example", **local),
        AdminRequest("/admin/state", origin="null", **local),
        AdminRequest("/admin/state", client_host="127.0.0.1", host="evil.example:8000"),
        AdminRequest("/admin/state", client_host="127.0.0.1", host=None),
    ):
        assert admin_access(req, None).status == 403, req
    # ... and cross-site stays refused with the token; the token opens any Host.
    bearer = f"Bearer {TOKEN}"
    remote = {"client_host": "192.0.2.7", "host": "gw.internal", "authorization": bearer}
    assert admin_access(AdminRequest("/admin/reload", "POST", **remote), TOKEN).allow
    crossed = AdminRequest("/admin/state", origin="http://evil.example", **remote)
    assert admin_access(crossed, TOKEN).status == 403
    same = AdminRequest("/admin/state", origin="http://gw.internal", **remote)
    assert admin_access(same, TOKEN).allow
    # Same origin spelled with the default port omitted on both sides, and IPv6.
    v6 = {"client_host": "::1", "host": "[::1]:8000", "origin": "http://[::1]:8000"}
    assert admin_access(AdminRequest("/admin/state", **v6), None).allow
    # Not admin: untouched whatever the headers.
    assert admin_access(AdminRequest("/v1/models", sec_fetch_site="cross-site"), None).allow
