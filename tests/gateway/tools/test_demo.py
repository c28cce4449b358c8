"""`shapegate demo --burst` end to end: four simulated engines, the gateway, a burst."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

from gateway.tools.demo import taken_ports
from tests.support.checkout import ROOT, checkout_env, gateway_cli
from tests.support.servers import free_port


def free_engine_base() -> int:
    """A base whose four engine ports are free now, below the ephemeral range (32768+), where
    other processes' outgoing connections would take them at random."""
    for _ in range(100):
        base = free_port() // 100 * 100 % 20000 + 10000
        if not taken_ports({base + k: "engine" for k in (1, 2, 11, 12)}):
            return base
    raise AssertionError("no free engine ports")


def test_the_demo_runs_a_burst_through_both_lanes() -> None:
    base = free_engine_base()
    proc = subprocess.run(
        gateway_cli(
            "demo",
            "--burst",
            "--burst-requests",
            "12",
            "--burst-monsters",
            "1",
            "--time-scale",
            "0.005",
            "--port",
            str(free_port()),
            "--engine-port-base",
            str(base),
            "--exit-after-burst",
        ),
        cwd=ROOT,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "dashboard  http://127.0.0.1:" in proc.stdout
    lanes = {
        line.split()[0]: int(line.split()[1])
        for line in proc.stdout.splitlines()
        if line.startswith(("fast ", "heavy "))
    }
    assert lanes == {"fast": 12, "heavy": 1}
    # The policy to edit and how to apply it; its folder is gone once the demo stopped.
    (policy,) = [line.split()[1] for line in proc.stdout.splitlines() if "  policy " in line]
    assert policy.endswith("demo.yaml")
    assert "curl --fail-with-body -X POST -H 'x-shapegate-admin: 1' http://127.0.0.1:" in (
        proc.stdout
    )
    assert not Path(policy).parent.exists()


def test_the_demo_refuses_taken_ports_and_names_them() -> None:
    with socket.socket() as gateway, socket.socket() as engine:
        gateway.bind(("127.0.0.1", 0))
        gateway.listen()
        engine.bind(("127.0.0.1", 0))
        engine.listen()
        port = gateway.getsockname()[1]
        base = engine.getsockname()[1] - 12  # the second heavy engine's port
        args = ["--port", str(port), "--engine-port-base", str(base)]
        proc = subprocess.run(
            gateway_cli("demo", *args),
            capture_output=True,
            cwd=ROOT,
            env=checkout_env(),
            text=True,
            timeout=60,
            check=False,
        )
    assert proc.returncode == 2
    # (another process may hold one of the other engine ports too: it would be named as well)
    assert f"ports already in use: {port} (gateway, --port), " in proc.stderr, proc.stderr
    assert f"{base + 12} (heavy engine, --engine-port-base)" in proc.stderr, proc.stderr
    assert "is up" not in proc.stdout


def test_the_sdks_work_unchanged_against_the_demo(tmp_path: Path) -> None:
    """As a new user would: start `shapegate demo`, point the openai and anthropic SDKs at it."""
    import signal
    import time

    import anthropic
    import httpx
    import openai
    import pytest

    base = free_engine_base()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["demo", "--time-scale", "0.005", "--port", str(port), "--engine-port-base", str(base)]
    log = tmp_path / "demo.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            gateway_cli(*args), cwd=ROOT, env=checkout_env(), stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass  # not listening yet
            assert proc.poll() is None, log.read_text()
            time.sleep(0.5)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        claude = anthropic.Anthropic(base_url=url, api_key="unused")
        reply = client.responses.create(model="qwen3.6", input="hi", max_output_tokens=3)
        assert reply.output_text == " lorem ipsum dolor"
        streamed = list(
            client.responses.create(model="qwen3.6", input="hi", max_output_tokens=2, stream=True)
        )
        assert streamed[-1].type == "response.completed"
        # The demo's engines serve Qwen3.6, a generate-only model: vLLM registers no pooling
        # routes for it and answers 404 {"detail": "Not Found"}, relayed as it is.
        with pytest.raises(openai.NotFoundError) as refused:
            client.embeddings.create(model="qwen3.6", input="hi")
        assert refused.value.response.json() == {"detail": "Not Found"}
        assert client.models.retrieve("qwen3.6").id == "qwen3.6"
        tools: list[anthropic.types.ToolParam] = [
            {"name": "f", "input_schema": {"type": "object", "properties": {}}}
        ]
        message = claude.messages.create(
            model="qwen3.6",
            max_tokens=3,
            tools=tools,
            messages=[{"role": "user", "content": "hi"}],
        )
        assert message.content[0].type == "text" and message.usage.output_tokens == 3
        with claude.messages.stream(
            model="qwen3.6", max_tokens=2, tools=tools, messages=[{"role": "user", "content": "hi"}]
        ) as stream:
            assert "".join(stream.text_stream) == " lorem ipsum"
        missing = httpx.post(url + "/v1/no-such-route", json={})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
        client.close()
        claude.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
