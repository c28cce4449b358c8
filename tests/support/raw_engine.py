"""A raw-asyncio HTTP/1.1 engine whose connection behaviour a test scripts exactly.

uvicorn (and so the FakeEngine) always frames and closes connections correctly; real engines
and proxies in front of them do not always. ``RawEngine(answer)`` calls ``answer(index, on_conn)``
for every POST (``index``: the engine's request count from 0; ``on_conn``: the request's number
on its connection from 0) and does what it returns:

    ("ok", None)            200 with a small chat completion (Content-Length, keep-alive)
    ("500", close_after_s)  500 with an OpenAI error body, keep-alive *not* refused, and the
                            socket closed ``close_after_s`` later (None: left open)
    ("drop", None)          close the connection without a byte of an answer

``GET /health`` and ``GET /metrics`` answer 200 so the gateway's prober and scraper are content.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import orjson

Action = tuple[str, float | None]

OK_BODY = orjson.dumps(
    {
        "id": "chatcmpl-raw",
        "object": "chat.completion",
        "created": 1,
        "model": "qwen3.6",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
)
ERROR_BODY = orjson.dumps(
    {
        "error": {
            "message": "engine failed",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }
)


def _response(status: int, reason: str, body: bytes) -> bytes:
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class RawEngine:
    def __init__(self, answer: Callable[[int, int], Action]) -> None:
        self.answer = answer
        self.posts = 0
        self.connections = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        on_conn = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path = lines[0].split(" ")[:2]
                size = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        size = int(value.strip())
                if size:
                    await reader.readexactly(size)
                if method == "GET":
                    writer.write(_response(200, "OK", b"" if path == "/metrics" else b"{}"))
                    await writer.drain()
                    continue
                action, delay = self.answer(self.posts, on_conn)
                self.posts += 1
                on_conn += 1
                if action == "drop":
                    break
                if action == "500":
                    writer.write(_response(500, "Internal Server Error", ERROR_BODY))
                    await writer.drain()
                    if delay is not None:
                        await asyncio.sleep(delay)
                        break
                    continue
                writer.write(_response(200, "OK", OK_BODY))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @asynccontextmanager
    async def serving(self, port: int = 0) -> AsyncIterator[str]:
        def spawn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.create_task(self._serve(reader, writer))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        server = await asyncio.start_server(spawn, "127.0.0.1", port)
        port = server.sockets[0].getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await server.wait_closed()
