"""The async driver: runs the pure ``Scheduler`` on a scaled clock and feeds each request's stream.

Contract:
- ``SimEngine(profile, time_scale=X)``: simulated time runs 1/X times faster than wall time
  (0.01 = 100x faster). A step of ``d`` simulated seconds ends at the absolute wall deadline
  ``t0 + end * X``; when the event loop falls behind (tiny steps at a small scale), steps run
  back to back until the engine catches up, so simulated timings stay exact and only delivery
  is late. Every time the engine reports (records, metrics) is simulated seconds, except the
  ``*_wall`` fields of records.
- ``submit(...)`` queues a request and returns its ``RequestStream``; tokens appear at the end
  of the step that produced them (first token: the step that completes the prefill).
- ``abort(key)`` removes the request from the scheduler at once: its seat and KV are free for
  the very next step. Idempotent; a no-op for a finished request.
- ``crash(reason)`` aborts everything (the engine died); open streams raise ``EngineCrashed``
  with that reason.
- The engine loop is a background task started by ``start()`` and cancelled by ``stop()``; if it
  ever fails, it logs ``error.swallowed``, the engine reports itself dead (``failed``), its
  requests end as an engine-core death ends them (``engine_dead``) and ``on_failure`` is called
  (the server then exits, as vLLM's does).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable

import structlog

from engine_pool.sim.metrics import SimMetrics
from engine_pool.sim.profile import EngineProfile
from engine_pool.sim.records import RequestLog, RequestRecord
from engine_pool.sim.scheduler import Scheduler, SchedulerSnapshot, StepResult

log = structlog.get_logger(component="sim.engine")


class EngineCrashed(Exception):
    """The engine died while this request was in it; ``reason`` says how (``crash``: the
    process is gone, its connections with it; ``engine_dead``: the engine core died under a
    live API server, which still answers)."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(key)
        self.reason = reason


class RequestStream:
    """One request's view of the engine: how many output tokens exist, and whether it is over."""

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self._generated = 0
        self._delivered = 0
        self._finished = False
        self._crashed: str | None = None
        self._event = asyncio.Event()

    @property
    def key(self) -> str:
        return self.record.key

    def _push(self, finished: bool) -> None:
        self._generated += 1
        self._finished = finished
        self._event.set()

    def _crash(self, reason: str) -> None:
        self._crashed = reason
        self._event.set()

    async def next_tokens(self) -> tuple[int, int, bool]:
        """Wait for new tokens: (index of the first new one, how many, is this the end)."""
        while self._delivered == self._generated and self._crashed is None:
            self._event.clear()
            await self._event.wait()
        if self._crashed is not None:
            raise EngineCrashed(self.key, self._crashed)
        start, self._delivered = self._delivered, self._generated
        return start, self._generated - start, self._finished


class SimEngine:
    def __init__(
        self,
        profile: EngineProfile,
        *,
        time_scale: float = 1.0,
        metrics: SimMetrics | None = None,
    ) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.profile = profile
        self.time_scale = time_scale
        self.metrics = metrics or SimMetrics(
            profile.model, kv_capacity_tokens=profile.scheduler.kv_capacity_tokens
        )
        self.requests = RequestLog()
        self.failed = False
        self.on_failure: Callable[[], object] | None = None
        self._scheduler = Scheduler(profile.scheduler, profile.costs)
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._t0 = time.monotonic()
        self._clock = 0.0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def now(self) -> float:
        """Simulated seconds since the engine was created."""
        return (time.monotonic() - self._t0) / self.time_scale

    def snapshot(self) -> SchedulerSnapshot:
        return self._scheduler.snapshot()

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"sim-engine-{self.profile.name}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self.crash(reason="stopped")

    def submit(
        self, request_id: str, *, route: str, prompt_tokens: int, output_tokens: int
    ) -> RequestStream:
        key = f"{next(self._ids)}:{request_id}"
        record = RequestRecord(
            request_id=request_id,
            key=key,
            route=route,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            arrived_s=self.now(),
            arrived_wall=time.time(),
        )
        self._scheduler.add(key, prompt_tokens, output_tokens, record.arrived_s)
        self.requests.add(record)
        stream = self._streams[key] = RequestStream(record)
        self._wake.set()
        return stream

    def abort(self, key: str, reason: str = "client_disconnect") -> bool:
        """Free the request's seat and KV now; True if it was still in the engine."""
        stream = self._streams.pop(key, None)
        in_engine = self._scheduler.abort(key)
        if stream is None:
            return False
        # Marked even when its last step already ran but is not delivered yet (the engine loop
        # sleeps until the step's end): the client left before the tokens reached it, and a
        # record left "running" for ever would read as engine work leaked.
        self._mark_aborted(stream.record, reason)
        return in_engine

    def crash(self, reason: str = "crash") -> None:
        for key in self._scheduler.abort_all():
            stream = self._streams.pop(key, None)
            if stream is not None:
                self._mark_aborted(stream.record, reason)
                stream._crash(reason)

    def _mark_aborted(self, record: RequestRecord, reason: str) -> None:
        record.aborted_s = self.now()
        record.aborted_wall = time.time()
        record.abort_reason = reason
        log.info(
            "sim.request_aborted",
            request_id=record.request_id,
            reason=reason,
            tokens_generated=record.tokens_generated,
        )

    async def _run(self) -> None:
        try:
            while True:
                if not self._scheduler.has_work:
                    self._wake.clear()
                    await self._wake.wait()
                    # Start at the arrival itself, not at the (later) moment the loop woke up:
                    # at a small time scale, wake-up latency would read as seconds of TTFT.
                    self._clock = max(self._clock, self._scheduler.next_arrival() or 0.0)
                    continue
                result = self._scheduler.step(self._clock)
                if result is None:
                    # Only requests stamped after the engine's (lagging) clock are waiting.
                    nxt = self._scheduler.next_arrival()
                    if nxt is None or nxt <= self._clock:
                        raise RuntimeError("scheduler cannot make progress")
                    self._clock = nxt
                    continue
                delay = self._t0 + result.end * self.time_scale - time.monotonic()
                await asyncio.sleep(max(delay, 0.0))
                self._clock = result.end
                self._deliver(result)
        except Exception as exc:
            # The gateway's error.swallowed fields (gateway/observe/log.py), with the traceback.
            log.exception(
                "error.swallowed",
                where="sim.engine_loop",
                error_type=type(exc).__name__,
                error=str(exc)[:500],
                decision="engine_failed",
            )
            self.failed = True
            self.crash(reason="engine_dead")
            if self.on_failure is not None:
                self.on_failure()

    def _deliver(self, result: StepResult) -> None:
        wall = time.time()
        for key in result.first_tokens:
            stream = self._streams.get(key)
            if stream is not None:
                record = stream.record
                record.first_token_s, record.first_token_wall = result.end, wall
                self.metrics.ttft.observe(result.end - record.arrived_s)
                self.metrics.prompt_tokens.inc(record.prompt_tokens)
        finished = set(result.finished)
        for key in result.tokens:
            stream = self._streams.get(key)
            if stream is None:  # aborted while its step ran
                continue
            stream.record.tokens_generated += 1
            self.metrics.generation_tokens.inc()
            stream._push(finished=key in finished)
            if key in finished:
                stream.record.finished_s, stream.record.finished_wall = result.end, wall
                del self._streams[key]
