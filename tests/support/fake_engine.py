"""A scriptable OpenAI-compatible engine for gateway tests (raw ASGI, real sockets).

Each request's body may carry ``"fake": {...}`` (forwarded untouched by the gateway) telling the
engine how to behave: ``mode`` one of ``ok`` (default), ``error`` (status + vLLM error body),
``hang`` (never answer), ``slow_first_byte`` (``delay`` before anything), ``stall`` (send
``chunks`` chunks then go silent), ``drop`` (send ``chunks`` then cut the connection).
``chunks`` and ``gap`` shape a stream; ``prompt_tokens`` is the usage it reports (default 1).
``payload`` (a JSON object) is sent as the whole non-streamed answer, ``events`` (strings) as
the stream's bytes, for routes whose answers are not chat's (Responses, Messages).
The engine records, per ``x-request-id`` (and in ``history``, every request in order), when the
request arrived and when its connection was closed or the response completed, so tests can
check that abandoned requests were closed upstream.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass
class Seen:
    request_id: str
    path: str
    body: bytes
    headers: dict[str, str]
    arrived: float = field(default_factory=time.monotonic)
    closed: float | None = None
    completed: bool = False


def chat_chunk(i: int, content: str) -> bytes:
    payload = {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "qwen3.6",
        "choices": [
            {"index": 0, "delta": {"content": content}, "logprobs": None, "finish_reason": None}
        ],
    }
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class FakeEngine:
    def __init__(self) -> None:
        self.seen: dict[str, Seen] = {}
        # Every request in order of arrival (``seen`` keeps the last of each request id).
        self.history: list[Seen] = []
        self.in_flight = 0
        self.peak_in_flight = 0
        # GET /health answers this status (None: never answers, like a hung engine).
        self.health_status: int | None = 200
        self.health_delay = 0.0
        # GET /metrics answers this status (an engine started without its metrics, say).
        self.metrics_status = 200
        self.health_answered = 0  # GET /health answers sent
        # (block_size, num_gpu_blocks): /metrics exports vllm:cache_config_info and /v1/models
        # answers, as vLLM does; None: neither (the capability stays unread).
        self.cache_config: tuple[int, int] | None = None
        # /metrics exports process_start_time_seconds with this value (None: not at all).
        self.started_s: float | None = None
        self.generated = 0

    async def _get(self, path: str, send: Any) -> None:
        if path == "/health":
            if self.health_status is None:
                await asyncio.Event().wait()
            await asyncio.sleep(self.health_delay)
            status, payload = self.health_status, b""
            self.health_answered += 1
        elif path == "/metrics":
            status = self.metrics_status
            payload = (
                f'vllm:num_requests_running{{model_name="qwen3.6"}} {self.in_flight}\n'
                f'vllm:num_requests_waiting{{model_name="qwen3.6"}} 0\n'
                f'vllm:kv_cache_usage_perc{{model_name="qwen3.6"}} 0.25\n'
                f'vllm:generation_tokens_total{{model_name="qwen3.6"}} {self.generated}\n'
            ).encode()
            if self.started_s is not None:
                payload += f"process_start_time_seconds {self.started_s}\n".encode()
            if self.cache_config is not None:
                block, blocks = self.cache_config
                payload += (
                    f'vllm:cache_config_info{{block_size="{block}",engine="0",'
                    f'num_gpu_blocks="{blocks}"}} 1.0\n'
                ).encode()
        elif path == "/v1/models" and self.cache_config is not None:
            status, payload = 200, b'{"object": "list", "data": [{"id": "qwen3.6"}]}'
        else:
            status, payload = 404, b"{}"
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": payload})

    def open_requests(self) -> list[Seen]:
        return [s for s in self.seen.values() if s.closed is None]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["method"] == "GET":
            await self._get(scope["path"], send)
            return
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        rid = headers.get("x-request-id", f"anon-{len(self.seen)}")
        seen = self.seen[rid] = Seen(rid, scope["path"], body, headers)
        self.history.append(seen)
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        responder = asyncio.create_task(self._respond(body, send, seen))
        disconnect = asyncio.create_task(self._wait_disconnect(receive))
        try:
            done, _ = await asyncio.wait(
                {responder, disconnect}, return_when=asyncio.FIRST_COMPLETED
            )
            if responder in done:
                seen.completed = responder.exception() is None
        finally:
            for task in (responder, disconnect):
                task.cancel()
            seen.closed = time.monotonic()
            self.in_flight -= 1

    @staticmethod
    async def _wait_disconnect(receive: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def _respond(self, body: bytes, send: Any, seen: Seen) -> None:
        # A multipart body (audio routes) carries no JSON: answer it as a plain request.
        data = (
            {}
            if seen.headers.get("content-type", "").startswith("multipart/")
            else orjson.loads(body)
        )
        fake = data.get("fake") or {}
        mode = fake.get("mode", "ok")
        chunks = int(fake.get("chunks", 3))
        gap = float(fake.get("gap", 0.0))
        prompt_tokens = int(fake.get("prompt_tokens", 1))
        if mode == "hang":
            await asyncio.Event().wait()
        if mode == "slow_first_byte":
            await asyncio.sleep(float(fake.get("delay", 1.0)))
        if mode == "error":
            status = int(fake.get("status", 500))
            payload = orjson.dumps(
                {
                    "error": {
                        "message": fake.get("message", "engine failed"),
                        "type": "InternalServerError",
                        "param": None,
                        "code": status,
                    }
                }
            )
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": payload})
            return
        if "payload" in fake and not data.get("stream"):
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": orjson.dumps(fake["payload"])})
            return
        if "events" in fake:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")],
                }
            )
            for event in fake["events"]:
                await send(
                    {"type": "http.response.body", "body": event.encode(), "more_body": True}
                )
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if not data.get("stream"):
            payload = orjson.dumps(
                {
                    "id": "chatcmpl-fake",
                    "object": "chat.completion",
                    "created": 1,
                    "model": data.get("model"),
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "ok " * chunks},
                            "logprobs": None,
                            "finish_reason": "length",
                        }
                    ],
                    "usage": {
                        "prompt_tokens": prompt_tokens,
                        "total_tokens": prompt_tokens + chunks,
                        "completion_tokens": chunks,
                    },
                }
            )
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"x-engine", b"fake"),
                        (b"server", b"fake-engine/1.0"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": payload})
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8")],
            }
        )
        for i in range(chunks):
            self.generated += 1
            await send(
                {"type": "http.response.body", "body": chat_chunk(i, f"t{i} "), "more_body": True}
            )
            if gap:
                await asyncio.sleep(gap)
        if mode == "stall":
            await asyncio.Event().wait()
        if mode == "drop":
            raise ConnectionResetError("fake engine drops the connection")
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
