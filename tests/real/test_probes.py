"""After boot, with real vLLM servers behind it: the gateway's probes answer 200, every lane is
up, and the admin state shows each engine up with its load read from vLLM's own /metrics."""

from __future__ import annotations

import httpx

from tests.real.engines import Real


def test_probes_and_readyz_answer_200_after_boot(real: Real) -> None:
    with httpx.Client(timeout=10) as client:
        assert client.get(real.gateway.url + "/healthz").status_code == 200
        ready = client.get(real.gateway.url + "/readyz")
        assert ready.status_code == 200, ready.text
        body = ready.json()
        assert body["ready"] is True
        assert {name: lane["state"] for name, lane in body["lanes"].items()} == {
            "fast": "ready",
            "heavy": "ready",
        }, body
        assert body["degraded"] is False
        for engine in real.engines.values():
            assert client.get(engine.url + "/health").status_code == 200


def test_the_admin_state_shows_each_engine_up_with_its_real_load(real: Real) -> None:
    state = real.gateway.state()
    endpoints = {c["name"]: c["endpoints"] for c in state["clusters"]}
    for name, engine in real.engines.items():
        (endpoint,) = endpoints[name]
        assert endpoint["url"] == engine.url
        assert endpoint["state"] == "up", endpoint
        # Read from vLLM's /metrics (vllm:num_requests_running, ...): a number, and fresh.
        assert endpoint["running"] is not None and endpoint["kv_usage"] is not None, endpoint
        assert endpoint["load_age_s"] is not None and endpoint["load_age_s"] < 10, endpoint
