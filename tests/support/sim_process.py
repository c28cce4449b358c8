"""Simulated engines as processes of their own, so a test can ``kill -9`` one under load."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.support.servers import free_port

ROOT = Path(__file__).resolve().parents[2]


class SimProcess:
    """``shapegate sim`` on a free loopback port; ``kill()`` sends SIGKILL, ``restart()`` starts
    it again on the same port."""

    def __init__(self, profile: str = "h100-fast", time_scale: float = 1.0, seed: int = 1) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = (profile, time_scale, seed)
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen[bytes]:
        profile, time_scale, seed = self.args
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gateway.tools.cli",
                "sim",
                "--port",
                str(self.port),
                "--profile",
                profile,
                "--time-scale",
                str(time_scale),
                "--seed",
                str(seed),
                "--log-level",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd=ROOT,
        )

    def wait_healthy(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode()[-2000:] if self.proc.stderr else ""
                raise AssertionError(f"sim exited early: {err}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"sim on {self.url} never answered /health")

    def restart(self) -> None:
        """Kill (if alive) and start again on the same port, healthy when this returns."""
        self.stop()
        self.proc = self._spawn()
        self.wait_healthy()

    def kill(self) -> float:
        """SIGKILL now; the wall time it was sent."""
        at = time.time()
        self.proc.kill()
        return at

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


@contextmanager
def sim_processes(count: int, **options: float | str) -> Iterator[list[SimProcess]]:
    sims = [SimProcess(seed=i + 1, **options) for i in range(count)]  # type: ignore[arg-type]
    try:
        for sim in sims:
            sim.wait_healthy()
        yield sims
    finally:
        for sim in sims:
            sim.stop()
