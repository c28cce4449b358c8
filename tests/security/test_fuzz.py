"""Fuzz: thousands of generated OpenAI requests, valid and not, against a real gateway.

Hypothesis builds chat and completions bodies field by field from the OpenAI request schema,
with every field sometimes of the wrong type or out of range (messages, content parts, prompts
and token ids, model, max_tokens, stream, stream_options, tools, unknown fields), sometimes a
body that is not an object or not JSON, and sometimes a Content-Type other than JSON. They go
through real sockets (the gateway and a fake engine serve from their own thread, with
shapegate's own HTTP protocol). For every request: no 5xx from the gateway itself (the engine
never fails here), an error is the OpenAI error shape. After the run: no traceback and no
request answered 500 in the logs, and no slot held anywhere.

``SHAPEGATE_FUZZ_EXAMPLES`` sets the number of requests (default 2,400, in batches of six per
generated example; CI runs the default).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from gateway.count.tokens import TokenCounter
from gateway.edge.app import create_app
from gateway.edge.http_protocol import guarded_protocol
from gateway.settings import parse_settings
from tests.conftest import lanes_config
from tests.support.fake_engine import FakeEngine
from tests.support.servers import serve_asgi

EXAMPLES = int(os.environ.get("SHAPEGATE_FUZZ_EXAMPLES", "2400"))

# ---- strategies: the OpenAI request schema, and its near misses ----------------------------

# Drawn from pools (hypothesis draws a pool entry far faster than a fresh string or number),
# with fresh text now and then: thousands of requests fit in CI's time.
TEXTS = [
    "",
    "hi",
    "Summarise this document.",
    "日本語のテキスト",
    "emoji 🎉 and e\u0301 combining",
    "<|im_start|>user\n<|im_end|>",
    "\u0000 nul and \ud800 lone surrogate",
    "line\r\nbreaks\tand tabs",
    "' OR 1=1 --",
    '{"json": "in a string"}',
]
LONG = ["lorem ipsum dolor " * 200, "日本語のテキスト" * 400, "x" * 2500]
short_text = st.one_of(st.sampled_from(TEXTS), st.text(max_size=12))
# Past the test policy's exact-count threshold (2,000 tokens' worth of bytes) now and then.
text = st.one_of(*[st.sampled_from(TEXTS)] * 6, st.text(max_size=12), st.sampled_from(LONG))
scalar = st.one_of(
    st.sampled_from(
        [None, True, False, 0, 1, -1, 7, 2**31, 2**63, 2**64, -(2**70), 0.5, -1.5, 1e308, "", "1"]
    ),
    st.integers(),
    short_text,
)
json_value = st.recursive(
    scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(TEXTS), inner, max_size=3)
    ),
    max_leaves=6,
)


def _part(kind: str, field: str, value: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.fixed_dictionaries({"type": st.just(kind), field: value})


good_part = st.one_of(
    _part("text", "text", text),
    _part("image_url", "image_url", st.fixed_dictionaries({"url": st.just("data:image/png;,")})),
    _part(
        "input_audio",
        "input_audio",
        st.fixed_dictionaries({"data": st.just("UklGRg=="), "format": st.just("wav")}),
    ),
)
bad_part = st.one_of(
    _part("text", "text", st.one_of(st.none(), st.integers(), st.lists(short_text, max_size=3))),
    _part("image_url", "image_url", st.one_of(st.none(), st.integers(), st.just({}))),
    st.fixed_dictionaries({"type": short_text}),
    json_value,
)
content = st.one_of(
    text,
    st.none(),
    st.lists(good_part, max_size=4),
    st.lists(st.one_of(good_part, bad_part), min_size=1, max_size=4),
    json_value,
)
role = st.one_of(st.sampled_from(["system", "developer", "user", "assistant", "tool"]), scalar)
message = st.one_of(
    st.fixed_dictionaries({"role": role, "content": content}),
    st.fixed_dictionaries(
        {"role": st.just("assistant"), "content": st.one_of(st.none(), text)},
        optional={
            "tool_calls": st.lists(
                st.fixed_dictionaries(
                    {
                        "id": short_text,
                        "type": st.just("function"),
                        "function": st.fixed_dictionaries(
                            {"name": short_text, "arguments": st.one_of(short_text, json_value)}
                        ),
                    }
                ),
                max_size=2,
            )
        },
    ),
    json_value,
)
token_ids = st.lists(st.integers(-5, 200_000), max_size=20)
prompt = st.one_of(
    text,
    st.lists(text, max_size=4),
    token_ids,
    st.lists(token_ids, max_size=3),
    json_value,
)
model = st.one_of(st.sampled_from(["qwen3.6"] * 6 + ["nope", ""]), scalar)
common = {
    "max_tokens": st.one_of(st.integers(-3, 300), st.integers(10**6, 10**30), scalar),
    "max_completion_tokens": st.one_of(st.integers(-3, 300), scalar),
    "stream": st.one_of(st.booleans(), scalar),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), scalar),
    "temperature": scalar,
    "n": scalar,
    "user": scalar,
    "tools": st.one_of(
        st.lists(
            st.fixed_dictionaries(
                {
                    "type": st.just("function"),
                    "function": st.fixed_dictionaries(
                        {"name": short_text, "parameters": json_value}
                    ),
                }
            ),
            max_size=2,
        ),
        json_value,
    ),
    "unknown_field": json_value,
}
messages = st.one_of(*[st.lists(message, min_size=1, max_size=5)] * 6, json_value)
chat_body = st.fixed_dictionaries({"model": model, "messages": messages}, optional=common)
completion_body = st.fixed_dictionaries(
    {"model": model, "prompt": st.one_of(*[prompt] * 6, st.nothing())}, optional=common
)


def dumps(value: Any) -> bytes:
    """JSON as a client library writes it: big integers as they are, non-ASCII escaped (so a
    lone surrogate travels as its escape)."""
    return json.dumps(value).encode()


valid_options = {
    "max_tokens": st.integers(1, 64),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "temperature": st.floats(0, 2),
    "user": short_text,
}
valid_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant"]),
        "content": st.one_of(text, st.lists(good_part, min_size=1, max_size=3)),
    }
)
valid_chat = st.fixed_dictionaries(
    {"model": st.just("qwen3.6"), "messages": st.lists(valid_message, min_size=1, max_size=4)},
    optional=valid_options,
)
valid_prompt = st.one_of(
    text.filter(bool),
    st.lists(text.filter(bool), min_size=1, max_size=3),
    st.lists(st.integers(0, 150_000), min_size=1, max_size=20),
)
valid_completion = st.fixed_dictionaries(
    {"model": st.just("qwen3.6"), "prompt": valid_prompt}, optional=valid_options
)
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
path_and_body = st.one_of(
    st.tuples(st.just(CHAT), valid_chat.map(dumps)),
    st.tuples(st.just(COMPLETIONS), valid_completion.map(dumps)),
    st.tuples(st.just(CHAT), chat_body.map(dumps)),
    st.tuples(st.just(COMPLETIONS), completion_body.map(dumps)),
    st.tuples(
        st.sampled_from([CHAT, COMPLETIONS]),
        st.one_of(json_value.map(dumps), st.binary(max_size=64)),
    ),
)
content_type = st.sampled_from(
    ["application/json"] * 12
    + ["application/json; charset=utf-8", "text/plain", "application/x-www-form-urlencoded", ""]
)
request = st.tuples(path_and_body, content_type).map(lambda r: (r[0][0], r[0][1], r[1]))
# Requests per generated example: hypothesis' own cost per example is paid once per batch.
BATCH = 6


# ---- a gateway on real sockets, serving from its own thread --------------------------------


@contextmanager
def gateway_thread(counter: TokenCounter) -> Iterator[tuple[str, FakeEngine]]:
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        stop = asyncio.Event()
        box["stop"] = (asyncio.get_running_loop(), stop)
        engine = FakeEngine()
        async with serve_asgi(engine) as engine_url:
            config = parse_settings(lanes_config([engine_url], [engine_url]), environ={})
            app = create_app(config, counter)
            async with serve_asgi(app, http=guarded_protocol(config.server)) as url:
                box["url"], box["engine"] = url, engine
                ready.set()
                await stop.wait()

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # surfaced to the test below
            box["error"] = exc
            ready.set()

    thread = threading.Thread(target=run, name="fuzz-gateway", daemon=True)
    thread.start()
    ready.wait(60)
    if "error" in box:
        raise box["error"]
    try:
        yield box["url"], box["engine"]
    finally:
        loop, stop = box["stop"]
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)


class _Errors(logging.Handler):
    """Records log records at ERROR and above (uvicorn's "Exception in ASGI application")."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.slow
def test_generated_requests_never_get_a_gateway_5xx_nor_leave_anything_held(
    counter: TokenCounter,
) -> None:
    statuses: dict[int, int] = {}
    errors = _Errors()
    logging.getLogger().addHandler(errors)
    started = time.monotonic()
    try:
        with (
            gateway_thread(counter) as (url, engine),
            httpx.Client(base_url=url, timeout=30) as client,
            capture_logs() as logs,
        ):

            @settings(
                max_examples=-(-EXAMPLES // BATCH),
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(st.lists(request, min_size=BATCH, max_size=BATCH))
            def batch(requests: list[tuple[str, bytes, str]]) -> None:
                for path, body, media in requests:
                    headers = {"content-type": media} if media else {}
                    r = client.post(path, content=body, headers=headers)
                    statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                    assert r.status_code < 500, (r.status_code, body[:300], r.text[:300])
                    if r.status_code >= 400:
                        error = r.json()["error"]
                        assert error["code"] == r.status_code and error["message"], r.text
                        assert set(error) == {"message", "type", "param", "code"}
                    elif r.headers["content-type"].startswith("application/json"):
                        r.json()

            batch()
            state = client.get("/admin/state").json()
            held = [(lane["name"], lane["slots_in_use"]) for lane in state["lanes"]]
            endpoints = [
                e["slots_in_use"] for cluster in state["clusters"] for e in cluster["endpoints"]
            ]
            assert all(n == 0 for _, n in held) and not any(endpoints), (held, endpoints)
            assert state["in_flight"] == 0
            assert not engine.open_requests()
    finally:
        logging.getLogger().removeHandler(errors)
    took = time.monotonic() - started
    sent = sum(statuses.values())
    print(f"\nfuzz: {sent} requests in {took:.1f}s, statuses {dict(sorted(statuses.items()))}")
    assert sent >= EXAMPLES
    assert statuses.get(200, 0) > sent // 10, statuses  # the valid share reached the engine
    assert len({s for s in statuses if s >= 400}) >= 3, statuses  # and the refusals vary
    failures = [e for e in logs if e["event"] in ("request.failed", "error.swallowed")]
    assert not failures, failures[:3]
    assert not any("exc_info" in e or "exception" in e for e in logs)
    assert not errors.records, [r.getMessage() for r in errors.records[:3]]
