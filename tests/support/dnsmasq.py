"""A real DNS server for discovery tests: Debian's ``dnsmasq`` on a free loopback UDP port,
answering names under ``.test`` from a hosts file it re-reads on ``reload()`` (SIGHUP)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def free_udp_port() -> int:
    """A loopback port free for UDP and for TCP (dnsmasq listens on both)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind(("127.0.0.1", 0))
            port = int(udp.getsockname()[1])
            with socket.socket() as tcp:
                try:
                    tcp.bind(("127.0.0.1", port))
                except OSError:
                    continue
        return port


class Dnsmasq:
    def __init__(self, workdir: Path) -> None:
        self.port = free_udp_port()
        self.nameserver = f"127.0.0.1:{self.port}"
        self.hosts = workdir / "dns-hosts"
        self.hosts.write_text("")
        self.proc: subprocess.Popen[bytes] | None = None

    def set_hosts(self, records: dict[str, list[str]]) -> None:
        """name -> addresses, written to the hosts file; call ``reload()`` to publish."""
        self.hosts.write_text(
            "".join(f"{address} {name}\n" for name, ads in records.items() for address in ads)
        )

    def reload(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)

    def start(self) -> Dnsmasq:
        # A port free a moment ago may be taken by the time dnsmasq binds it: try another.
        for _ in range(3):
            try:
                return self._start()
            except RuntimeError:
                self.stop()
                self.port = free_udp_port()
                self.nameserver = f"127.0.0.1:{self.port}"
        return self._start()

    def _start(self) -> Dnsmasq:
        binary = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"
        if not Path(binary).exists():
            raise RuntimeError("dnsmasq is not installed (apt-get install dnsmasq)")
        self.proc = subprocess.Popen(
            [
                binary,
                "--keep-in-foreground",
                "--conf-file=/dev/null",
                f"--port={self.port}",
                "--listen-address=127.0.0.1",
                "--bind-interfaces",
                "--no-resolv",
                "--no-hosts",
                f"--addn-hosts={self.hosts}",
                "--local=/test/",  # unknown names under .test: NXDOMAIN, never forwarded
                "--local-ttl=0",
                "--user=root",  # the hosts file sits in a root-only temporary directory
                "--pid-file=",
                "--log-facility=-",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dnsmasq on port {self.port} did not start")
            time.sleep(0.02)
        return self

    def _answers(self) -> bool:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(0.2)
            query = (
                b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x01x\x04test\x00\x00\x01\x00\x01"
            )
            try:
                s.sendto(query, ("127.0.0.1", self.port))
                return bool(s.recv(512))
            except OSError:
                return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@contextmanager
def dnsmasq(workdir: Path) -> Iterator[Dnsmasq]:
    server = Dnsmasq(workdir)
    try:
        yield server.start()
    finally:
        server.stop()
