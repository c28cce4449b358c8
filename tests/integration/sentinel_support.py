"""A real Redis Sentinel deployment for the tests: a primary, one replica and three sentinels
(Debian's ``redis-server`` and ``redis-sentinel``) on free loopback ports, with fast timings
(down after 1 s), so a ``kill -9`` of the primary is followed by a promotion within seconds."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from tests.integration.redis_support import RedisProcess, answers_ping
from tests.support.servers import free_port

MASTER = "shapegate"
DOWN_AFTER_MS = 1000


def _sentinel_binary() -> str:
    for name in ("redis-sentinel", "/usr/bin/redis-sentinel"):
        found = shutil.which(name)
        if found:
            return found
    raise RuntimeError("redis-sentinel is not installed (apt-get install redis-sentinel)")


class SentinelDeployment:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.primary = RedisProcess()
        self.replica = RedisProcess()
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.sentinels: list[subprocess.Popen[bytes]] = []
        self.last_state: list[str] = []

    @property
    def hosts(self) -> list[str]:
        return [f"127.0.0.1:{port}" for port in self.sentinel_ports]

    def start(self) -> SentinelDeployment:
        self.primary.start()
        self.replica.start()
        replica = redis.Redis(port=self.replica.port, socket_timeout=2)
        replica.replicaof("127.0.0.1", self.primary.port)
        replica.close()
        binary = _sentinel_binary()
        for port in self.sentinel_ports:
            conf = self.workdir / f"sentinel-{port}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\nprotected-mode no\n"
                f"dir {self.workdir}\n"
                f"sentinel monitor {MASTER} 127.0.0.1 {self.primary.port} 2\n"
                f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {MASTER} 2000\n"
                f"sentinel parallel-syncs {MASTER} 1\n"
            )
            self.sentinels.append(
                subprocess.Popen(
                    [binary, str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            )
        self._wait(self._settled, 30, "the sentinels to see each other and the replica")
        return self

    def _settled(self) -> bool:
        self.last_state = []
        for port in self.sentinel_ports:
            if not answers_ping(f"redis://127.0.0.1:{port}"):
                self.last_state.append(f"{port}: no answer")
                return False
            client = redis.Redis(port=port, socket_timeout=1, decode_responses=True)
            try:
                state = client.sentinel_master(MASTER)
                replicas = client.sentinel_slaves(MASTER)
            except redis.RedisError as exc:
                self.last_state.append(f"{port}: {exc!r}")
                return False
            finally:
                client.close()
            linked = [r for r in replicas if r.get("master-link-status") == "ok"]
            self.last_state.append(f"{port}: {state['num-other-sentinels']} others, {replicas}")
            if int(state["num-other-sentinels"]) < 2 or not linked:
                return False
        return True

    def master_port(self) -> int | None:
        """The primary's port as a majority of the sentinels name it, None without one."""
        votes: dict[int, int] = {}
        for port in self.sentinel_ports:
            client = redis.Redis(port=port, socket_timeout=0.5, decode_responses=True)
            try:
                address = client.sentinel_get_master_addr_by_name(MASTER)
            except (redis.RedisError, OSError):
                continue
            finally:
                client.close()
            if address:
                votes[int(address[1])] = votes.get(int(address[1]), 0) + 1
        best = max(votes.items(), key=lambda kv: kv[1], default=None)
        return best[0] if best and best[1] >= 2 else None

    def promoted(self) -> bool:
        """The replica is the primary, as the sentinels say and as it says itself."""
        if self.master_port() != self.replica.port:
            return False
        client = redis.Redis(port=self.replica.port, socket_timeout=0.5)
        try:
            return bool(client.info("replication")["role"] == "master")
        finally:
            client.close()

    def _wait(self, check: object, within_s: float, what: str) -> None:
        deadline = time.monotonic() + within_s
        while not check():  # type: ignore[operator]
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}: {self.last_state}")
            time.sleep(0.05)

    def stop(self) -> None:
        for proc in self.sentinels:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        self.primary.stop()
        self.replica.stop()


@contextmanager
def sentinel_deployment(workdir: Path) -> Iterator[SentinelDeployment]:
    deployment = SentinelDeployment(workdir)
    try:
        yield deployment.start()
    finally:
        deployment.stop()
