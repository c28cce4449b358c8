"""Real Redis servers, a slow TCP proxy and gateway subprocesses for the integration tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
import redis
import yaml

from tests.support.checkout import ROOT, checkout_env, gateway_cli
from tests.support.servers import free_port


def answers_ping(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_timeout=0.3, socket_connect_timeout=0.3)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


SHARED_URL = "redis://127.0.0.1:6379/0"


@contextlib.contextmanager
def shared_or_own_redis() -> Iterator[str]:
    """The URL of the Redis on 127.0.0.1:6379 if it answers PING, else of a ``redis-server``
    of our own on a free port, stopped on exit."""
    if answers_ping(SHARED_URL):
        yield SHARED_URL
        return
    server = RedisProcess().start()
    try:
        yield server.url
    finally:
        server.stop()


class RedisProcess:
    """A ``redis-server`` of our own on a free port, with no persistence, that tests may stop,
    restart (same port, empty data, as after a crash) or freeze."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisProcess:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
                # A replica's full sync writes an RDB file: never into the checkout.
                "--dir",
                tempfile.gettempdir(),
                "--dbfilename",
                f"shapegate-test-{self.port}.rdb",
                # A replica syncs at once, not after the default 5 s wait for more replicas.
                "--repl-diskless-sync-delay",
                "0",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while not answers_ping(self.url):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def freeze(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)


@contextmanager
def own_redis() -> Iterator[RedisProcess]:
    server = RedisProcess().start()
    try:
        yield server
    finally:
        server.stop()


def new_prefix() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def delete_prefix(url: str, prefix: str) -> None:
    client = redis.Redis.from_url(url, socket_timeout=2)
    try:
        keys = list(client.scan_iter(match="{" + prefix + "}:*", count=500))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def live_members(url: str, prefix: str, key: str) -> int:
    """Live leases (score above Redis TIME) in one limit, read past any proxy."""
    client = redis.Redis.from_url(url, socket_timeout=2)
    try:
        secs, micros = client.time()
        now_ms = secs * 1000 + micros // 1000
        return int(client.zcount("{" + prefix + "}:" + key, f"({now_ms}", "+inf"))
    finally:
        client.close()


@asynccontextmanager
async def delay_proxy(target_port: int, delay_s: float) -> AsyncIterator[int]:
    """A TCP proxy that holds every client->server chunk for ``delay_s`` (order kept), so each
    Redis call takes ``delay_s`` longer. Yields the proxy's port."""
    tasks: set[asyncio.Task[None]] = set()

    async def pump(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float
    ) -> None:
        try:
            while data := await reader.read(65536):
                if delay:
                    due = time.monotonic() + delay
                    await asyncio.sleep(max(0.0, due - time.monotonic()))
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target_port)
        for task in (
            asyncio.create_task(pump(reader, up_writer, delay_s)),
            asyncio.create_task(pump(up_reader, writer, 0.0)),
        ):
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield port
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


class GatewayProcess:
    """``shapegate serve --config FILE --port P`` as a subprocess; its JSON log lines are kept."""

    def __init__(self, config: dict[str, Any], workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_path = workdir / f"gateway-{self.port}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / f"gateway-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> GatewayProcess:
        env = checkout_env({k: v for k, v in os.environ.items() if not k.startswith("SHAPEGATE_")})
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                gateway_cli("serve", "--config", str(self.config_path), "--port", str(self.port)),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
            )
        deadline = time.monotonic() + 30
        async with httpx.AsyncClient() as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"gateway exited at start-up:\n{self.log_text()[-3000:]}")
                with suppress(httpx.TransportError):
                    if (await client.get(self.url + "/readyz", timeout=1)).status_code < 500:
                        return self
                if time.monotonic() > deadline:
                    raise RuntimeError(f"gateway did not start:\n{self.log_text()[-3000:]}")
                await asyncio.sleep(0.05)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def events(self, name: str) -> list[str]:
        return [line for line in self.log_text().splitlines() if f'"event":"{name}"' in line]

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
