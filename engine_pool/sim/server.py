"""One simulated engine on a real loopback socket, in-process, with a crash switch.

Contract:
- ``SimServer(profile, ...)``: ``await start()`` binds ``host:port`` (port 0 picks a free one,
  kept for restarts) and serves the app with uvicorn inside the running event loop;
  ``await stop()`` aborts whatever the engine still holds and resets every connection, as a
  process exit would (no graceful drain: tests must not wait on hung streams).
- ``await set_faults(spec)`` replaces the faults. ``crash`` closes the listening socket
  (connection refused) and resets every open connection, as a dead process would; clearing it
  (or ``restart_after_s``) listens again on the same port with the same engine records, its
  ``process_start_time_seconds`` moved to that moment (a restarted vLLM is a new process).
  ``dead`` is vLLM's engine-core death: every running request ends at once (streams with an
  error event), the server keeps answering (new generations 500, ``/health`` 200) for
  ``exit_after_s``, then exits as ``crash`` does; ``restart_after_s`` brings it back after that.
  The engine loop failing (a simulator bug) ends the same way.
- ``run_sim(profile, time_scale=0.01)`` is the test helper: ``async with run_sim(...) as sim``
  gives ``sim.url``, ``sim.engine`` (records, snapshot), ``sim.faults`` and ``sim.set_faults``.
  ``counter`` (engine_pool/sim/counting.py) reads and counts the prompts; pass one to many
  simulated engines to share one loaded tokenizer.

uvicorn internals touched, on purpose and only here: ``Server.servers`` (the listening sockets),
``server_state.connections`` (to reset them) and ``server_state.tasks`` (to let their handlers
finish); signal capture is disabled because several servers share one process (the CLI
installs its own handlers).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Generator, Mapping
from typing import Any

import structlog
import uvicorn

from engine_pool.sim.app import create_app
from engine_pool.sim.counting import PromptCounter
from engine_pool.sim.engine import SimEngine
from engine_pool.sim.faults import FaultSpec, FaultState
from engine_pool.sim.handling import SimParts
from engine_pool.sim.profile import EngineProfile, load_profile
from engine_pool.sim.records import RequestRecord
from engine_pool.sim.serving import DroppedConnection

log = structlog.get_logger(component="sim.server")


class _NoSignals(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class _DroppedConnectionFilter(logging.Filter):
    """An injected connection drop is a fault, not an application error worth a traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
            exc = exc.exceptions[0]
        return not isinstance(exc, DroppedConnection)


def _quiet_dropped_connections() -> None:
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _DroppedConnectionFilter) for f in logger.filters):
        logger.addFilter(_DroppedConnectionFilter())


class SimServer:
    def __init__(
        self,
        profile: EngineProfile,
        *,
        counter: PromptCounter,
        time_scale: float = 1.0,
        host: str = "127.0.0.1",
        port: int = 0,
        faults: FaultSpec | None = None,
        seed: int | None = None,
    ) -> None:
        self.profile = profile
        self.host = host
        self.port = port
        self.engine = SimEngine(profile, time_scale=time_scale)
        self.faults = FaultState(faults, seed=seed)
        self.counter = counter
        self.app = create_app(
            SimParts(profile, self.engine, self.faults, self.counter), self._set_faults_from_admin
        )
        self._server: _NoSignals | None = None
        self._task: asyncio.Task[None] | None = None
        self._restart: asyncio.Task[None] | None = None
        self._deferred: asyncio.Task[None] | None = None
        self._dying: asyncio.Task[None] | None = None
        # Listening again after this is a restart (a new process start time on /metrics).
        self._listened = False
        self.engine.on_failure = lambda: self._die(0.5, restart_after_s=None)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def listening(self) -> bool:
        return self._server is not None

    def requests(self, request_id: str | None = None) -> list[RequestRecord]:
        return self.engine.requests.find(request_id)

    async def start(self) -> None:
        _quiet_dropped_connections()
        await self.engine.start()
        if self.port == 0:
            with socket.socket() as probe:
                probe.bind((self.host, 0))
                self.port = int(probe.getsockname()[1])
        await self.set_faults(self.faults.spec)
        log.info(
            "sim.started",
            profile=self.profile.name,
            url=self.url,
            time_scale=self.engine.time_scale,
            listening=self.listening,
        )

    async def stop(self) -> None:
        for task in (self._restart, self._deferred, self._dying):
            if task is not None:
                task.cancel()
        # Like a process exit: every request ends, every connection is reset. A graceful drain
        # would keep a test waiting on hung or long streams for the whole drain timeout.
        await self.engine.stop()
        await self._close()

    async def set_faults(self, spec: FaultSpec | Mapping[str, Any]) -> None:
        spec = spec if isinstance(spec, FaultSpec) else FaultSpec.parse(dict(spec))
        self.faults.set(spec)
        if self._restart is not None:
            self._restart.cancel()
            self._restart = None
        if self._dying is not None and not spec.dead:
            self._dying.cancel()
            self._dying = None
        if spec.dead and not spec.crash:
            if not self.listening:
                await self._listen()
            if self._dying is None:
                self.faults.injected["dead"] += 1
                self.engine.crash(reason="engine_dead")
                log.info("sim.engine_dead", url=self.url, exit_after_s=spec.exit_after_s)
                self._die(spec.exit_after_s, spec.restart_after_s)
            return
        if spec.crash and self.listening:
            self.faults.injected["crash"] += 1
            self.engine.crash()
            await self._close()
            log.info("sim.crashed", url=self.url)
        elif not spec.crash and not self.listening:
            await self._listen()
        if spec.crash and spec.restart_after_s is not None:
            self._restart = asyncio.create_task(self._restart_after(spec.restart_after_s))

    async def _set_faults_from_admin(self, spec: FaultSpec) -> None:
        if not (spec.crash and self.listening):
            await self.set_faults(spec)
            return

        # Resetting connections at once could destroy the admin response still in flight.
        async def crash_soon() -> None:
            await asyncio.sleep(0.05)
            await self.set_faults(spec)

        self._deferred = asyncio.create_task(crash_soon())

    def _die(self, exit_after_s: float, restart_after_s: float | None) -> None:
        """vLLM after its engine core died: the API server lives on for a moment (health 200,
        requests 500), then exits."""

        async def exit_soon() -> None:
            await asyncio.sleep(exit_after_s)
            await self._close()
            log.info("sim.exited", url=self.url)
            if restart_after_s is not None:
                await asyncio.sleep(restart_after_s)
                self._dying = None  # set_faults would otherwise cancel the task running it
                await self.set_faults(self.faults.spec.model_copy(update={"dead": False}))

        if self._dying is None:
            self._dying = asyncio.create_task(exit_soon())

    async def _restart_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        self._restart = None  # set_faults would otherwise cancel the task running it
        await self.set_faults(
            self.faults.spec.model_copy(update={"crash": False, "restart_after_s": None})
        )

    async def _listen(self) -> None:
        # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted sockets whose
        # proto says TCP, and without it every JSON response waits 40 ms for a delayed ACK.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
        server = _NoSignals(config)
        task = asyncio.create_task(server.serve(sockets=[sock]), name=f"sim-http-{self.port}")
        while not server.started:
            if task.done():
                task.result()  # raises the start-up error
                raise RuntimeError(f"simulated engine failed to listen on {self.url}")
            await asyncio.sleep(0.002)
        self._server, self._task = server, task
        if self._listened:
            self.engine.metrics.restarted()
        self._listened = True

    async def _close(self) -> None:
        server, task = self._server, self._task
        self._server = self._task = None
        if server is None or task is None:
            return
        for listener in server.servers:
            listener.close()  # connection refused from now on
        for connection in list(server.server_state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None:
                transport.abort()  # RST, like the kernel closing a dead process's sockets
        server.force_exit = server.should_exit = True
        await asyncio.wait_for(task, 10)
        # The reset connections' handlers see the disconnect and finish: let them, so no task
        # outlives the server.
        if server.server_state.tasks:
            await asyncio.wait(set(server.server_state.tasks), timeout=2)


@contextlib.asynccontextmanager
async def run_sim(
    profile: EngineProfile | str,
    *,
    counter: PromptCounter,
    time_scale: float = 1.0,
    faults: FaultSpec | Mapping[str, Any] | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    seed: int | None = None,
) -> AsyncIterator[SimServer]:
    """Start a simulated engine on a free loopback port for the duration of the block."""
    if not isinstance(profile, EngineProfile):
        profile = load_profile(profile)
    if faults is not None and not isinstance(faults, FaultSpec):
        faults = FaultSpec.parse(dict(faults))
    server = SimServer(
        profile,
        time_scale=time_scale,
        host=host,
        port=port,
        faults=faults,
        counter=counter,
        seed=seed,
    )
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
