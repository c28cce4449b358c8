"""`shapegate demo --burst` end to end: four simulated engines, the gateway, a burst."""

from __future__ import annotations

import subprocess

from tests.support.checkout import ROOT, checkout_env, gateway_cli
from tests.support.servers import free_port


def test_the_demo_runs_a_burst_through_both_lanes() -> None:
    base = free_port() // 100 * 100 % 50000 + 10000
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
