"""`shapegate demo` as a user drives it: the commands it prints, run exactly as printed, work;
stopped with Ctrl-C it starts again at once on the same ports.

One test runs the whole story on one demo (the suite's time: a demo is four engines and a
gateway), then starts the second demo the restart needs.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import orjson

from gateway.tools.demo import taken_ports
from tests.gateway.tools.test_demo import free_engine_base
from tests.support.checkout import ROOT, checkout_env, gateway_cli
from tests.support.servers import free_port

BOOT_S = 150.0


def start_demo(port: int, base: int, log: Path) -> subprocess.Popen[bytes]:
    args = ["demo", "--time-scale", "0.005", "--port", str(port), "--engine-port-base", str(base)]
    with log.open("wb") as out:
        return subprocess.Popen(
            gateway_cli(*args), cwd=ROOT, env=checkout_env(), stdout=out, stderr=subprocess.STDOUT
        )


def printed_block(proc: subprocess.Popen[bytes], log: Path) -> list[str]:
    """The lines the demo printed once up (its last one names the logs folder)."""
    deadline = time.monotonic() + BOOT_S
    while time.monotonic() < deadline:
        lines = log.read_text(errors="replace").splitlines()
        if any(line.startswith("  logs ") for line in lines):
            return lines
        assert proc.poll() is None, "\n".join(lines)
        time.sleep(0.2)
    raise AssertionError("the demo did not come up:\n" + log.read_text(errors="replace"))


def after(lines: list[str], marker: str) -> str:
    (found,) = [line.split(marker, 1)[1].strip() for line in lines if marker in line]
    return found


def policy_version(url: str) -> int:
    version: int = httpx.get(url + "/admin/state", timeout=10).json()["policy_version"]
    return version


def chat(client: httpx.Client, url: str) -> httpx.Response:
    body = {"model": "qwen3.6", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return client.post(url + "/v1/chat/completions", json=body, timeout=30)


def test_printed_commands_work_and_a_stopped_demo_restarts_at_once(tmp_path: Path) -> None:
    base, port = free_engine_base(), free_port()
    ports = {port: "gateway", **{base + k: "engine" for k in (1, 2, 11, 12)}}
    url = f"http://127.0.0.1:{port}"
    first = start_demo(port, base, tmp_path / "first.log")
    try:
        lines = printed_block(first, tmp_path / "first.log")
        # Every URL it prints answers.
        for name in ("dashboard", "metrics", "state"):
            printed_url = after(lines, f"  {name} ")
            assert httpx.get(printed_url, timeout=10).status_code == 200, name
        # The reload command, run exactly as printed (a shell), answers 200 and bumps the version.
        version = policy_version(url)
        reload = after(lines, "edit the policy, then: ")
        done = subprocess.run(
            ["bash", "-c", reload], capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 0, (reload, done.stdout, done.stderr)
        assert orjson.loads(done.stdout)["version"] == version + 1, done.stdout
        assert policy_version(url) == version + 1
        # So does the other one it prints: SIGHUP reloads in the background.
        hup = after(lines, "             or: ")
        assert hup.startswith("kill -HUP ")
        done = subprocess.run(
            ["bash", "-c", hup], capture_output=True, text=True, timeout=30, check=False
        )
        assert done.returncode == 0, done.stderr
        deadline = time.monotonic() + 30
        while policy_version(url) != version + 2:
            assert time.monotonic() < deadline, "kill -HUP did not reload the policy"
            time.sleep(0.1)
        # Traffic, so that keep-alive connections (client -> gateway -> engines) exist.
        with httpx.Client() as client:
            for _ in range(8):
                assert chat(client, url).status_code == 200
            first.send_signal(signal.SIGINT)
            assert first.wait(timeout=60) == 0
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(timeout=30)
    stopped = time.monotonic()
    # What the old probe (a bind without SO_REUSEADDR) saw now: ports left in TIME_WAIT.
    lingering = []
    for p in ports:
        with socket.socket() as plain:
            try:
                plain.bind(("127.0.0.1", p))
            except OSError:
                lingering.append(p)
    assert not taken_ports(ports), taken_ports(ports)
    second = start_demo(port, base, tmp_path / "second.log")
    started_after = time.monotonic() - stopped
    try:
        printed_block(second, tmp_path / "second.log")
        with httpx.Client() as client:
            assert chat(client, url).status_code == 200
    finally:
        second.send_signal(signal.SIGINT)
        second.wait(timeout=60)
    assert started_after < 1.0, started_after
    print(f"restarted {started_after:.3f}s after the stop; ports in TIME_WAIT: {lingering}")


def test_a_port_someone_listens_on_is_still_taken() -> None:
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert taken_ports({port: "gateway, --port"}) == [f"{port} (gateway, --port)"]
    assert taken_ports({port: "gateway, --port"}) == []


def test_a_port_with_only_time_wait_connections_is_free() -> None:
    """A server that closes first leaves its side in TIME_WAIT: the port is free to listen on."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        accepted.close()  # the server's side closes first: it goes to TIME_WAIT
        client.recv(1)
        client.close()
    with socket.socket() as plain:  # what the old probe did
        try:
            plain.bind(("127.0.0.1", port))
            old_probe_taken = False
        except OSError:
            old_probe_taken = True
    assert old_probe_taken  # the situation the issue describes
    assert taken_ports({port: "engine"}) == []
