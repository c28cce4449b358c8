"""Hostile input: every case gets a 4xx in the OpenAI shape; nothing crashes, nothing leaks.

The gateway here runs with shapegate's own HTTP protocol (header deadline and size cap), as
`shapegate serve` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from typing import Any

import httpx
import orjson

from gateway.count.tokens import TokenCounter
from tests.conftest import JSON
from tests.security.edge import guarded_gateway, raw_exchange, status_and_error
from tests.support.waiting import wait_for


async def test_headers_with_cr_or_lf_and_oversized_headers(
    counter: TokenCounter, engine: Any
) -> None:
    async with guarded_gateway(counter, engine[1], max_header_bytes=4096) as url:
        bad = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            b"x-evil: a\rb\r\ncontent-length: 2\r\n\r\n{}"
        )
        status, error = status_and_error(await raw_exchange(url, bad))
        assert status == 400 and "malformed" in error["message"] and error["code"] == 400
        big = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            + b"x-pad: "
            + b"a" * 8000
            + b"\r\ncontent-length: 2\r\n\r\n{}"
        )
        status, error = status_and_error(await raw_exchange(url, big))
        assert status == 431 and "exceed 4096 bytes" in error["message"]
        assert not engine[0].seen


SLOWLORIS = r"""
import asyncio, json, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
request = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n"

async def drip():
    reader, writer = await asyncio.open_connection(host, port)
    started, got = time.monotonic(), b""
    for i in range(100_000):
        writer.write(request[i % len(request):][:1])
        try:
            got = await asyncio.wait_for(reader.read(4096), 0.2)
            break
        except asyncio.TimeoutError:
            continue
        except ConnectionError:
            break
    writer.close()
    return time.monotonic() - started, b" 408 " in got

async def main():
    results = await asyncio.gather(*(drip() for _ in range(n)))
    print(json.dumps(results))

asyncio.run(main())
"""


async def test_slowloris_is_cut_at_the_header_deadline_and_others_are_unaffected(
    counter: TokenCounter, engine: Any
) -> None:
    async with guarded_gateway(counter, engine[1], header_timeout_s=1.0) as url:
        host, port = url.removeprefix("http://").split(":")

        async def normal_traffic() -> list[float]:
            latencies = []
            async with httpx.AsyncClient() as client:
                for _ in range(40):
                    sent = time.monotonic()
                    r = await client.post(
                        url + "/v1/chat/completions",
                        json={"model": "qwen3.6", "messages": [{"role": "user", "content": "hi"}]},
                    )
                    assert r.status_code == 200
                    latencies.append(time.monotonic() - sent)
                    await asyncio.sleep(0.02)
            return latencies

        baseline = sorted(await normal_traffic())
        fds_before = open_fds()
        # The 200 slow clients run in their own process: this one holds the gateway under test.
        slow = await asyncio.create_subprocess_exec(
            sys.executable, "-c", SLOWLORIS, host, port, "200", stdout=asyncio.subprocess.PIPE
        )
        # Their connections are open in the gateway (one descriptor each) before we measure.
        await wait_for(lambda: open_fds() >= fds_before + 150, 10, what="slow clients connected")
        during = sorted(await normal_traffic())
        out, _ = await asyncio.wait_for(slow.communicate(), 30)
        # Every cut connection's descriptor is closed again, in this (the gateway's) process.
        await wait_for(lambda: open_fds() <= fds_before + 5, 5, what="descriptors closed")
    results = orjson.loads(out)
    assert all(0.9 < took < 3.0 for took, _ in results), sorted(t for t, _ in results)[-3:]
    assert sum(cut for _, cut in results) >= 190
    p99_before, p99_during = baseline[-1], during[-1]
    assert p99_during < max(0.25, 5 * p99_before), (p99_before, p99_during)


async def test_a_body_far_over_the_limit_is_refused_without_being_buffered(
    counter: TokenCounter, engine: Any
) -> None:
    limit = 1024 * 1024
    async with guarded_gateway(counter, engine[1], max_body_bytes=limit) as url:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        # Chunked, so no Content-Length announces the size: the gateway must count as it reads.
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        answer = asyncio.create_task(reader.read(65536))  # reading while we write
        chunk = b"100000\r\n" + b"x" * 0x100000 + b"\r\n"  # 1 MiB a chunk
        sent = 0
        with contextlib.suppress(ConnectionError):
            for _ in range(200):  # 200 MiB offered
                writer.write(chunk)
                await asyncio.wait_for(writer.drain(), 10)
                sent += len(chunk)
                if answer.done():
                    break
        response = await asyncio.wait_for(answer, 10)
        writer.transport.abort()
    assert response.startswith(b"HTTP/1.1 413 "), response[:200]
    status, error = status_and_error(response)
    assert status == 413 and error["type"] == "invalid_request_error", error
    assert sent < 50 * 1024 * 1024, "the gateway kept reading far past its limit"


async def test_deep_nesting_big_numbers_and_many_messages(
    counter: TokenCounter, engine: Any
) -> None:
    async with guarded_gateway(counter, engine[1]) as url, httpx.AsyncClient(timeout=30) as client:
        started = time.monotonic()
        r = await client.post(
            url + "/v1/chat/completions", content=b"[" * 100_000 + b"]" * 100_000, headers=JSON
        )
        assert r.status_code == 400 and time.monotonic() - started < 0.5
        r = await client.post(
            url + "/v1/chat/completions",
            content=(
                b'{"model":"qwen3.6","messages":[{"role":"user","content":"x"}],'
                b'"max_tokens":99999999999999999999999}'
            ),
            headers=JSON,
        )
        assert r.status_code == 400
        r = await client.post(
            url + "/v1/chat/completions",
            json={
                "model": "qwen3.6",
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 10**12,
            },
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        many = {"model": "qwen3.6", "messages": [{"role": "user", "content": "x"}] * 100_000}
        started = time.monotonic()
        r = await client.post(url + "/v1/chat/completions", json=many)
        assert r.status_code == 200 and time.monotonic() - started < 5
        state = (await client.get(url + "/admin/state")).json()
        assert all(lane["slots_in_use"] == 0 for lane in state["lanes"])


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))
