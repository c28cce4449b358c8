"""``shapegate sim``: the simulated engine as its own process, and its engine profiles."""

from __future__ import annotations

import signal
import socket
import subprocess
import time

import httpx
import pytest

from engine_pool.sim.profile import available_profiles, load_profile
from gateway.tools.cli import main
from tests.support.checkout import ROOT, checkout_env, gateway_cli


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_health(url: str, proc: subprocess.Popen[bytes], timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"sim exited early: {proc.communicate()[1].decode()[-2000:]}")
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code
        except httpx.TransportError:
            time.sleep(0.05)
    raise AssertionError("sim never answered /health")


def test_every_engine_profile_loads() -> None:
    names = available_profiles()
    assert {"h100-shared", "h100-heavy", "h100-fast"} <= set(names)
    for name in names:
        profile = load_profile(name)
        assert profile.model == "qwen3.6" and profile.scheduler.max_num_partial_prefills == 1


def test_sim_subprocess_serves_until_sigterm() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        gateway_cli(
            "sim",
            "--port",
            str(port),
            "--profile",
            "h100-fast",
            "--time-scale",
            "0.01",
            "--model",
            "tiny",
            "--faults",
            "error_500_rate=1",
            "--enable-force-include-usage",
        ),
        cwd=ROOT,
        env=checkout_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert wait_for_health(url, proc) == 200
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        refused = httpx.post(f"{url}/v1/chat/completions", json=chat)
        assert refused.status_code == 500  # started with the faults asked
        assert httpx.post(f"{url}/sim/faults", json={}).status_code == 200
        time.sleep(0.05)
        assert httpx.get(f"{url}/health").status_code == 200
        r = httpx.post(
            f"{url}/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
            },
        )
        assert r.status_code == 200 and r.json()["model"] == "tiny"
        # vLLM's --enable-force-include-usage: usage on every chunk, unasked.
        streamed = httpx.post(f"{url}/v1/chat/completions", json={**chat, "stream": True})
        chunks = [line for line in streamed.text.split("\n\n") if line.startswith("data: {")]
        assert len(chunks) == 5 and all('"usage":' in chunk for chunk in chunks)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0
    assert b'"event":"sim.started"' in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--profile", "no-such-engine"], "cannot read engine profile"),
        (["--faults", "explode"], "explode"),
        (["--time-scale", "0"], "--time-scale must be positive"),
    ],
)
def test_bad_arguments_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sim", "--port", "1", *argv]) == 2
    assert message in capsys.readouterr().err
