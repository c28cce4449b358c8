"""``shapegate serve --workers N``: one supervisor process and N worker processes.

The supervisor handles no HTTP. It
- reserves the port (bound with SO_REUSEPORT, never listening, which also resolves port 0) and
  each worker listens on its own SO_REUSEPORT socket on it: the kernel spreads new connections
  evenly over the workers' accept queues by address hash. (One socket shared by all workers
  was the first design: there, the worker that wakes first accepts every connection waiting,
  since asyncio and uvloop accept up to the backlog per wake-up, and a burst of 30 new
  connections all went to one worker in one of three test runs. The price of SO_REUSEPORT:
  connections still waiting in a dying worker's queue are reset.);
- makes a private runtime directory (mode 0700) for its unix sockets: the slot server's
  (``slots.sock``, gateway/slots/host_server.py, when ``state.backend`` is ``memory``: the slots
  of all workers are then kept here, exact, and a dead worker's come back at once) and each worker's
  own (``worker-<i>.sock``, which the other workers query for the gateway-wide metrics, admin
  state and dashboard and to pass on a reload: gateway/edge/peers.py);
- starts each worker as ``python -m gateway.tools.cli serve ... --worker-index i`` (a fresh
  interpreter: nothing is shared by fork but the socket);
- forwards SIGHUP to every worker (each re-reads the policy file), and on SIGTERM or SIGINT
  gives up the port's reservation and forwards SIGTERM: every worker stops
  accepting and drains its in-flight requests up to ``server.drain_timeout_s``; the
  supervisor exits 0 once every worker exited 0 (1 otherwise; a worker still running
  ``KILL_GRACE_S`` past the drain deadline is killed);
- starts a worker again when it dies on its own (``workers.exited``, then ``workers.restarted``
  after a back-off that doubles while it keeps dying young), except when it exited 2, the
  code for a policy it cannot serve (a tokenizer that fails to load): then every worker is
  stopped and the supervisor exits 2 (``workers.config_error``).

With ``state.backend: redis`` the workers use Redis as separate replicas would, and no slot
server runs. A worker that outlives its supervisor (kill -9) notices and drains itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gateway.observe.log import Logger, configure_logging, get_logger
from gateway.settings import Settings
from gateway.slots.host_server import SlotServer

KILL_GRACE_S = 10.0
CONFIG_ERROR = 2  # a worker's exit code for a policy it cannot serve (gateway/tools/cli.py)
RESTART_BACKOFF_S = (0.5, 10.0)
# A worker that ran this long before dying was not crash-looping: back-off starts over.
HEALTHY_RUN_S = 30.0


@dataclass
class _Worker:
    index: int
    process: asyncio.subprocess.Process
    started: float


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with SO_REUSEPORT that never listens: the port is ours
    (port 0 becomes a real one) and no connection is ever queued on it."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


class Supervisor:
    def __init__(
        self, settings: Settings, config_path: Path, count: int, log: Logger | None = None
    ) -> None:
        self.settings = settings
        self.config_path = config_path
        self.count = count
        self.log = log or get_logger("workers")
        self.runtime = Path(tempfile.mkdtemp(prefix="shapegate-"))
        self.workers: dict[int, _Worker] = {}
        self._listener: socket.socket | None = None
        self._stopping = asyncio.Event()
        self._backoff: dict[int, float] = {}
        self._failed = False

    def _argv(self, index: int, port: int) -> list[str]:
        return [
            *(
                sys.executable,
                "-m",
                "gateway.tools.cli",
                "serve",
                "--config",
                str(self.config_path),
            ),
            *("--host", self.settings.server.host, "--port", str(port)),
            *("--workers", str(self.count), "--worker-index", str(index)),
            *("--worker-dir", str(self.runtime)),
        ]

    async def _start(self, index: int) -> None:
        assert self._listener is not None
        port = self._listener.getsockname()[1]
        process = await asyncio.create_subprocess_exec(*self._argv(index, port))
        self.workers[index] = _Worker(index, process, time.monotonic())
        self.log.info("workers.worker_started", worker=index, pid=process.pid)

    async def _watch(self, index: int) -> None:
        """Wait for worker ``index``; start it again if it died while we were not stopping."""
        while True:
            worker = self.workers[index]
            code = await worker.process.wait()
            if self._stopping.is_set():
                return
            if code == CONFIG_ERROR:
                # What the user must fix (a tokenizer that does not load, say): starting it
                # again would fail the same way, so the whole gateway stops and says so.
                self.log.error("workers.config_error", worker=index, code=code)
                self._failed = True
                self._stop(signal.SIGTERM)
                return
            ran = time.monotonic() - worker.started
            low, high = RESTART_BACKOFF_S
            delay = low if ran > HEALTHY_RUN_S else min(high, self._backoff.get(index, low / 2) * 2)
            self._backoff[index] = delay
            self.log.error(
                "workers.exited",
                worker=index,
                pid=worker.process.pid,
                code=code,
                ran_s=round(ran, 3),
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)
            if self._stopping.is_set():
                return
            await self._start(index)
            self.log.info("workers.restarted", worker=index, after_s=delay)

    def _forward(self, signum: int) -> None:
        for worker in self.workers.values():
            if worker.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.send_signal(signum)

    def _stop(self, signum: int) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        self.log.info("workers.stopping", signal=signal.Signals(signum).name)
        # The port goes once the workers close their sockets: no new connection is taken.
        if self._listener is not None:
            self._listener.close()
        self._forward(signal.SIGTERM)

    async def run(self) -> int:
        server = self.settings.server
        self._listener = reserve_port(server.host, server.port)
        slots = None
        if self.settings.state.backend == "memory":
            slots = SlotServer(self.runtime / "slots.sock", self.log)
            await slots.start()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._stop, signum)
        loop.add_signal_handler(signal.SIGHUP, self._forward, signal.SIGHUP)
        try:
            for index in range(self.count):
                await self._start(index)
            self.log.info(
                "workers.started",
                workers=self.count,
                pids=[w.process.pid for w in self.workers.values()],
                slots="supervisor" if slots is not None else self.settings.state.backend,
                host=server.host,
                port=self._listener.getsockname()[1],
            )
            watchers = [asyncio.create_task(self._watch(i)) for i in range(self.count)]
            await self._stopping.wait()
            await asyncio.gather(*watchers)
            return await self._reap()
        finally:
            if slots is not None:
                await slots.aclose()
            shutil.rmtree(self.runtime, ignore_errors=True)

    async def _reap(self) -> int:
        """Every worker's exit code, killing any still running past the drain deadline."""
        deadline = self.settings.server.drain_timeout_s + KILL_GRACE_S
        codes: dict[str, int] = {}
        for index, worker in self.workers.items():
            try:
                codes[str(index)] = await asyncio.wait_for(worker.process.wait(), deadline)
            except TimeoutError:
                worker.process.kill()
                codes[str(index)] = await worker.process.wait()
        self.log.info("workers.stopped", codes=codes)
        if self._failed:
            return CONFIG_ERROR
        return 0 if all(code == 0 for code in codes.values()) else 1


def supervise(settings: Settings, config_path: Path, count: int) -> int:
    configure_logging(settings.logging.level, settings.logging.json_output)
    return asyncio.run(Supervisor(settings, config_path, count).run())
