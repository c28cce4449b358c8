"""Helpers for the hostile-input tests: a gateway on real sockets with shapegate's own HTTP
protocol (header deadline and size cap, as ``shapegate serve`` runs), and raw-socket exchanges."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson

from gateway.count.tokens import TokenCounter
from gateway.edge.app import create_app
from gateway.edge.http_protocol import guarded_protocol
from gateway.settings import parse_settings
from tests.conftest import lanes_config
from tests.support.servers import serve_asgi


@asynccontextmanager
async def guarded_gateway(
    counter: TokenCounter, engine_url: str, config: dict[str, Any] | None = None, **server: Any
) -> AsyncIterator[str]:
    config = config or lanes_config([engine_url], [engine_url])
    config["server"].update(server)
    settings = parse_settings(config, environ={})
    app = create_app(settings, counter)
    async with serve_asgi(app, http=guarded_protocol(settings.server)) as url:
        yield url


async def raw_exchange(url: str, payload: bytes, timeout: float = 5) -> bytes:
    """Send ``payload`` on a fresh connection and read until the server closes it."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(payload)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


def status_and_error(response: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, orjson.loads(body)["error"]
