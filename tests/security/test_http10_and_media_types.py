"""HTTP/1.0 framing and the JSON routes' media type, on raw sockets.

An HTTP/1.0 client cannot read chunked coding (RFC 9112 section 6.1): every response to it is
framed by Content-Length or by closing the connection. The JSON routes take
``application/json`` only (vLLM's rule); anything else is 415 in the OpenAI error shape.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.count.tokens import TokenCounter
from tests.security.edge import guarded_gateway, raw_exchange, status_and_error

CHAT = {"model": "qwen3.6", "messages": [{"role": "user", "content": "hello there"}]}


def request(
    body: bytes,
    *,
    version: bytes = b"1.0",
    path: bytes = b"/v1/chat/completions",
    content_type: bytes | None = b"application/json",
) -> bytes:
    head = b"POST %s HTTP/%s\r\nhost: 127.0.0.1\r\ncontent-length: %d\r\n" % (
        path,
        version,
        len(body),
    )
    if content_type is not None:
        head += b"content-type: " + content_type + b"\r\n"
    if version == b"1.1":
        head += b"connection: close\r\n"  # so the exchange ends with the response
    return head + b"\r\n" + body


def split(response: bytes) -> tuple[bytes, dict[bytes, bytes], bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    status_line, *lines = head.split(b"\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines)}
    return status_line, headers, body


async def test_http10_clients_get_length_or_close_framing_never_chunked(
    counter: TokenCounter, engine: Any
) -> None:
    async with guarded_gateway(counter, engine[1]) as url:
        # A stream: close-delimited, the SSE bytes exactly as the engine sent them.
        stream = orjson.dumps({**CHAT, "stream": True, "fake": {"chunks": 5}})
        status, headers, body = split(await raw_exchange(url, request(stream)))
        assert status.split(b" ")[1] == b"200", status
        assert b"transfer-encoding" not in headers and b"content-length" not in headers
        assert headers[b"connection"] == b"close"
        assert headers[b"content-type"].startswith(b"text/event-stream")
        events = [e for e in body.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]" and len(events) == 6, body[:300]
        assert all(e.startswith(b"data: ") for e in events)  # no chunk-size lines inside

        # Non-streaming, an error, and a route outside the pipeline: each by Content-Length.
        for raw in (
            request(orjson.dumps(CHAT)),
            request(b'{"model": 1}'),
            b"GET /healthz HTTP/1.0\r\n\r\n",
            b"GET /admin/state HTTP/1.0\r\nhost: 127.0.0.1\r\n\r\n",
        ):
            status, headers, body = split(await raw_exchange(url, raw))
            assert b"transfer-encoding" not in headers, (raw[:40], headers)
            assert int(headers[b"content-length"]) == len(body), raw[:40]
            orjson.loads(body)

        # HTTP/1.1 is unchanged: a stream without a length is chunked.
        status, headers, _ = split(await raw_exchange(url, request(stream, version=b"1.1")))
        assert headers[b"transfer-encoding"] == b"chunked"


async def test_json_routes_refuse_other_media_types_with_415(
    counter: TokenCounter, engine: Any
) -> None:
    fake, engine_url = engine
    body = orjson.dumps(CHAT)
    async with guarded_gateway(counter, engine_url) as url:
        for path in (b"/v1/chat/completions", b"/v1/completions"):
            for content_type in (
                b"text/plain",
                b"text/plain;charset=UTF-8",
                b"application/x-www-form-urlencoded",
                b"multipart/form-data; boundary=x",
                b"application/jsonx",
                b"application/json-seq",
                None,
            ):
                got = await raw_exchange(
                    url, request(body, version=b"1.1", path=path, content_type=content_type)
                )
                status, error = status_and_error(got)
                assert status == 415, (path, content_type, got[:200])
                assert error["code"] == 415 and error["type"] == "invalid_request_error"
                assert "application/json" in error["message"]
        assert not fake.seen
        # application/json with parameters and in any case is JSON.
        for content_type in (b"application/json; charset=utf-8", b"Application/JSON"):
            got = await raw_exchange(url, request(body, version=b"1.1", content_type=content_type))
            assert got.startswith(b"HTTP/1.1 200 "), got[:200]
        assert len(fake.seen) == 2
