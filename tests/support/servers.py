"""Run ASGI apps on real loopback sockets inside the test's event loop, or a gateway process."""

from __future__ import annotations

import asyncio
import socket
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def serve_asgi(app: Any, port: int | None = None, **config: Any) -> AsyncIterator[str]:
    """Serve ``app`` with uvicorn on 127.0.0.1 and yield its base URL."""
    port = port or free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            access_log=False,
            lifespan="on",
            loop="asyncio",
            timeout_graceful_shutdown=1,
            **config,
        )
    )
    server.config.setup_event_loop = lambda: None  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.005)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 15)


def start_gateway(config: Path, port: int) -> subprocess.Popen[bytes]:
    """``shapegate serve --config CONFIG --port PORT`` as a child process, output piped."""
    from tests.support.checkout import ROOT, checkout_env, gateway_cli

    return subprocess.Popen(
        gateway_cli("serve", "--config", str(config), "--port", str(port)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env=checkout_env(),
    )


async def until_ok(client: httpx.AsyncClient, url: str, tries: int = 600) -> None:
    """Poll ``url`` (every 50 ms) until it answers 200."""
    for _ in range(tries):
        try:
            if (await client.get(url)).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"{url} never answered 200")
