"""The fixed fast upstream of the benchmarks (``shapegate bench overhead``, ``memory``,
``monsters``, ``workers``: harness.py starts it), on raw asyncio sockets: no HTTP library of the
gateway's, so the gateway is the only thing measured twice.

``FixedUpstream`` (``python -m gateway.tools.bench.upstream --port P [--chunks N]``)
answers every ``POST`` with the same OpenAI-shaped chat completion: a JSON body with
``content-length``, or, when the request body says ``"stream": true``, ``N`` SSE chunks
(default 100) plus a usage chunk and ``[DONE]`` in chunked transfer encoding, written back
to back in one ``writelines`` (an engine spaces them by its inter-token latency; here the
relay's per-byte cost is what is measured, and at 1,000 requests/s a Python upstream cannot
afford 100 writes per response). ``GET /v1/models`` lists the one model (a gateway that
discovers its workers' models, such as smg, needs it); every other ``GET`` (health, metrics)
gets an empty 200. Keep-alive throughout.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from typing import cast

import httptools
import orjson

from gateway.tools.bench.httpload import new_event_loop

STREAM_CHUNKS = 100
_JSON_BODY = orjson.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": "qwen3.6",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello! How can I help you today?"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 9, "total_tokens": 21},
    }
)
_JSON_RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
    + str(len(_JSON_BODY)).encode()
    + b"\r\n\r\n"
    + _JSON_BODY
)
_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
_EMPTY_RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"


def _http_chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _sse_chunks(count: int) -> list[bytes]:
    chunks = []
    for i in range(count):
        event = {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 1_700_000_000,
            "model": "qwen3.6",
            "choices": [{"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}],
            "usage": None,
        }
        chunks.append(_http_chunk(b"data: " + orjson.dumps(event) + b"\n\n"))
    usage = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": "qwen3.6",
        "choices": [],
        "usage": {"prompt_tokens": 12, "completion_tokens": count, "total_tokens": 12 + count},
    }
    chunks.append(_http_chunk(b"data: " + orjson.dumps(usage) + b"\n\ndata: [DONE]\n\n"))
    chunks.append(b"0\r\n\r\n")
    return chunks


_MODELS_BODY = orjson.dumps(
    {"object": "list", "data": [{"id": "qwen3.6", "object": "model", "owned_by": "bench"}]}
)
_MODELS_RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
    + str(len(_MODELS_BODY)).encode()
    + b"\r\n\r\n"
    + _MODELS_BODY
)


class FixedUpstream(asyncio.Protocol):
    """One connection of the fixed upstream (httptools parses requests)."""

    def __init__(self, sse: Sequence[bytes]) -> None:
        self._sse = sse
        self._url = b""
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only duck-typed alike.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            assert self._transport is not None
            self._transport.close()

    def on_url(self, url: bytes) -> None:
        self._url = url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        transport = self._transport
        assert transport is not None
        body = b"".join(self._body)
        self._body.clear()
        if self._parser.get_method() != b"POST":
            transport.write(_MODELS_RESPONSE if self._url == b"/v1/models" else _EMPTY_RESPONSE)
        elif b'"stream":true' in body or b'"stream": true' in body:
            transport.writelines(self._sse)
        else:
            transport.write(_JSON_RESPONSE)


async def serve_upstream(host: str, port: int, chunks: int = STREAM_CHUNKS) -> None:
    loop = asyncio.get_running_loop()
    sse = [_SSE_HEAD, *_sse_chunks(chunks)]
    server = await loop.create_server(
        lambda: FixedUpstream(sse), host, port, backlog=4096, reuse_address=True
    )
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m gateway.tools.bench.upstream")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=STREAM_CHUNKS, help="SSE content chunks")
    args = parser.parse_args()
    with asyncio.Runner(loop_factory=new_event_loop()) as runner:
        runner.run(serve_upstream(args.host, args.port, args.chunks))


if __name__ == "__main__":
    main()
