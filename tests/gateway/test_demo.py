"""`shapegate demo --burst` end to end: four simulated engines, the gateway, a burst."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

from gateway.demo import taken_ports
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
    assert "curl -X POST http://127.0.0.1:" in proc.stdout and "/admin/reload" in proc.stdout
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
