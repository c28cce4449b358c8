"""The admin surface refuses what a web page (or a rebound DNS name) can make a browser send.

Reproduces the attack of issue 19: with no ``admin_token``, a ``text/plain`` POST (a "simple"
request, no CORS preflight) to ``/admin/reload`` from a cross-site page rewrote the policy so
that the next user's prompt went to the attacker's listener. Everything here goes through real
sockets to a gateway run with shapegate's own HTTP protocol.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import yaml

from gateway.count.tokens import TokenCounter
from tests.conftest import ADMIN, JSON, lanes_config
from tests.security.edge import guarded_gateway
from tests.support.fake_engine import FakeEngine
from tests.support.servers import serve_asgi

CHAT = {"model": "qwen3.6", "messages": [{"role": "user", "content": "canary-7f3a prompt"}]}


async def version(client: httpx.AsyncClient, url: str) -> int:
    state = await client.get(url + "/admin/state")
    assert state.status_code == 200, state.text
    value: int = state.json()["policy_version"]
    return value


async def test_a_cross_site_page_cannot_rewrite_the_policy(
    counter: TokenCounter, engine: Any
) -> None:
    fake, engine_url = engine
    listener = FakeEngine()  # the attacker's: it must never see a prompt
    async with (
        serve_asgi(listener) as evil_url,
        guarded_gateway(counter, engine_url) as url,
        httpx.AsyncClient(timeout=10) as client,
    ):
        port = url.rsplit(":", 1)[1]
        evil = yaml.safe_dump(lanes_config([evil_url], [evil_url])).encode()
        attempts: dict[str, dict[str, str]] = {
            # The reproduction: what a page's fetch(..., {mode: "no-cors"}) sends.
            "text/plain, cross-site": {
                "content-type": "text/plain",
                "origin": "http://attacker.example",
                "sec-fetch-site": "cross-site",
            },
            "form, cross-site Origin only": {
                "content-type": "application/x-www-form-urlencoded",
                "origin": "http://attacker.example",
            },
            "yaml, same-site but not same-origin": {
                **ADMIN,
                "sec-fetch-site": "same-site",
            },
            "opaque origin (sandboxed frame)": {**ADMIN, "origin": "null"},
            "no Origin, no admin header (an old browser's form post)": {
                "content-type": "text/plain"
            },
            "DNS rebinding: same origin under the attacker's name": {
                **ADMIN,
                "host": f"attacker.example:{port}",
                "origin": f"http://attacker.example:{port}",
                "sec-fetch-site": "same-origin",
            },
        }
        for name, headers in attempts.items():
            r = await client.post(url + "/admin/reload", content=evil, headers=headers)
            assert r.status_code == 403, (name, r.status_code, r.text)
            error = r.json()["error"]
            assert error["type"] == "permission_error" and error["code"] == 403, name
        # The non-simple header alone does not make a non-policy media type acceptable.
        r = await client.post(
            url + "/admin/reload",
            content=evil,
            headers={"content-type": "text/plain", "x-shapegate-admin": "1"},
        )
        assert r.status_code == 415 and r.json()["error"]["code"] == 415
        # Nor an oversized body (cut at 1 MiB, connection closed).
        r = await client.post(url + "/admin/reload", content=b"#" * (2 << 20), headers=ADMIN)
        assert r.status_code == 413
        assert await version(client, url) == 1
        chat = await client.post(url + "/v1/chat/completions", json=CHAT)
        assert chat.status_code == 200
        assert not listener.seen and len(fake.seen) == 1

        # The operator's own reload still works: curl with the header, or the body as JSON.
        r = await client.post(url + "/admin/reload", content=evil, headers=ADMIN)
        assert r.status_code == 200, r.text
        assert await version(client, url) == 2
        safe = lanes_config([engine_url], [engine_url])
        r = await client.post(
            url + "/admin/reload", json=safe, headers={"x-shapegate-admin": "1", **JSON}
        )
        assert r.status_code == 200 and await version(client, url) == 3
        # An empty body re-reads the config file (none here: a clear 400, no media type needed).
        r = await client.post(url + "/admin/reload", headers={"x-shapegate-admin": "1"})
        assert r.status_code == 400, r.text


async def test_cross_site_reads_and_probes_are_refused_same_origin_ones_served(
    counter: TokenCounter, engine: Any
) -> None:
    async with (
        guarded_gateway(counter, engine[1]) as url,
        httpx.AsyncClient(timeout=10) as client,
    ):
        for path in ("/admin/state", "/admin/dashboard.json"):
            refused = await client.get(url + path, headers={"sec-fetch-site": "cross-site"})
            assert refused.status_code == 403, path
            same = await client.get(
                url + path, headers={"sec-fetch-site": "same-origin", "origin": url}
            )
            assert same.status_code == 200, path
        # A link from another site may open the page itself (static, never framed).
        page = await client.get(url + "/dashboard", headers={"sec-fetch-site": "cross-site"})
        assert page.status_code == 200
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
        probe = await client.post(url + "/admin/probe")
        assert probe.status_code == 403
        assert "x-shapegate-admin" in probe.json()["error"]["message"]
        probe = await client.post(url + "/admin/probe", headers={"x-shapegate-admin": "1"})
        assert probe.status_code in (200, 503)
        # Not admin: clients and Prometheus are not asked for any of this.
        assert (await client.get(url + "/metrics")).status_code == 200


async def test_with_a_token_cross_site_is_refused_even_with_the_token(
    counter: TokenCounter, engine: Any
) -> None:
    token = "an-admin-token-0123456789"
    config = lanes_config([engine[1]], [engine[1]])
    async with (
        guarded_gateway(counter, engine[1], config=config, admin_token=token) as url,
        httpx.AsyncClient(timeout=10) as client,
    ):
        bearer = {"authorization": f"Bearer {token}"}
        # With the token, any Host is fine (a proxy in front), and no extra header is needed.
        r = await client.post(url + "/admin/probe", headers={**bearer, "host": "gw.internal"})
        assert r.status_code in (200, 503)
        r = await client.get(
            url + "/admin/state", headers={**bearer, "origin": "http://attacker.example"}
        )
        assert r.status_code == 403
        r = await client.post(url + "/admin/reload", content=b"x: 1", headers=bearer)
        assert r.status_code == 415
        await asyncio.sleep(0)
