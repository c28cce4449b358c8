"""The engine's usage is read on every route (defect 5): after a Responses or Messages request,
streamed or not, the gateway has checked its count against vLLM's ``input_tokens`` (one drift
observation on that route) and recorded vLLM's ``output_tokens`` as the request's output."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.real.engines import MODEL, Real
from tests.support.prom import Scrape
from tests.support.waiting import wait_for

BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "responses": ("/v1/responses", {"model": MODEL, "input": "hello", "max_output_tokens": 16}),
    "messages": (
        "/v1/messages",
        {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hello"}]},
    ),
}


def figures(scrape: Scrape, route: str) -> tuple[float, float, float]:
    return (
        scrape.value("shapegate_count_drift_tokens_count", route=route),
        scrape.value("shapegate_output_tokens_count", lane="fast", source="usage"),
        scrape.value("shapegate_output_tokens_sum", lane="fast", source="usage"),
    )


def output_tokens(route: str, stream: bool, text: str) -> int:
    """vLLM's own output_tokens, from the body or from the stream's closing event."""
    if not stream:
        return int(json.loads(text)["usage"]["output_tokens"])
    found = None
    for line in text.splitlines():
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[len("data: ") :])
        usage = (event.get("response") or {}).get("usage") or event.get("usage")
        if usage and usage.get("output_tokens") is not None:
            found = int(usage["output_tokens"])
    assert found is not None, f"no usage in the {route} stream:\n{text[-600:]}"
    return found


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("route", sorted(BODIES))
async def test_the_engines_usage_is_read_on_responses_and_messages(
    real: Real, route: str, stream: bool
) -> None:
    path, body = BODIES[route]
    drift0, outputs0, sum0 = figures(real.gateway.metrics(), route)
    async with httpx.AsyncClient(timeout=60) as client:
        answer = await client.post(real.gateway.url + path, json={**body, "stream": stream})
    assert answer.status_code == 200, answer.text
    produced = output_tokens(route, stream, answer.text)

    def recorded() -> tuple[float, float, float] | None:
        now = figures(real.gateway.metrics(), route)
        return now if now[1] > outputs0 or now[0] > drift0 else None

    try:
        now = await wait_for(recorded, 3, interval=0.1, what=f"{route} usage recorded")
    except AssertionError:
        now = figures(real.gateway.metrics(), route)
    assert (now[0] - drift0, now[1] - outputs0, now[2] - sum0) == (1, 1, produced), (
        f"after one {route} request ({'streamed' if stream else 'not streamed'}, vLLM output "
        f"{produced} tokens): drift observations +{now[0] - drift0:g}, output-token "
        f"observations from usage +{now[1] - outputs0:g} summing {now[2] - sum0:g}"
    )
