"""Health probes per endpoint, with the interval, timeout and thresholds of the lane served.

Failure classes are distinct, because they mean different things:

    refused / reset / 5xx   the engine is gone or broken: DOWN at once (a reset is asked again
                            once on a fresh connection: a kept-alive one may just have expired)
    timeout                 the engine is slow: an alert (``engine.slow``); DOWN only after the
                            lane's ``down_after_timeouts`` in a row, and never while the engine's
                            token counters still advance (busy with a long prefill, not dead)
    success                 UP again after ``up_after_successes`` in a row (hysteresis)

``judge`` is the pure state machine; ``Prober`` runs it on a timer for one endpoint and reports
each transition once as an ``engine.state_changed`` event with the evidence. A heavy lane's
engine decoding a 700k-token request answers probes slowly by design: its lane sets a longer
timeout, and progress keeps it routable.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import anyio
import httpx

from engine_pool.cluster import EngineState

ProbeStatus = Literal["ok", "timeout", "failed"]


@dataclass(frozen=True, slots=True)
class ProbeResult:
    outcome: ProbeStatus
    detail: str
    seconds: float


@dataclass(frozen=True, slots=True)
class Track:
    """What the state machine remembers about one endpoint."""

    state: EngineState = EngineState.UP
    timeouts_in_a_row: int = 0
    successes_in_a_row: int = 0


@dataclass(frozen=True, slots=True)
class Verdict:
    track: Track
    evidence: str
    # An alert-class event to raise (a slow probe), separate from any state change.
    alert: str | None = None
    # What the probe itself answered.
    probe: ProbeStatus = "ok"


@dataclass(frozen=True, slots=True)
class Thresholds:
    down_after_timeouts: int
    up_after_successes: int


def judge(track: Track, result: ProbeResult, progressing: bool, limits: Thresholds) -> Verdict:
    """The next state of an endpoint after one probe."""
    return replace(_judge(track, result, progressing, limits), probe=result.outcome)


def _judge(track: Track, result: ProbeResult, progressing: bool, limits: Thresholds) -> Verdict:
    if result.outcome == "failed":
        return Verdict(Track(EngineState.DOWN), f"probe failed: {result.detail}")
    if result.outcome == "timeout":
        timeouts = track.timeouts_in_a_row + (0 if progressing else 1)
        alert = f"probe timed out after {result.seconds:.1f}s" + (
            " while the engine's token counters advance" if progressing else ""
        )
        if track.state is EngineState.DOWN:
            return Verdict(replace(track, successes_in_a_row=0), alert, alert)
        if timeouts >= limits.down_after_timeouts:
            return Verdict(
                Track(EngineState.DOWN, timeouts_in_a_row=timeouts),
                f"{timeouts} probes in a row timed out with no token progress",
                alert,
            )
        return Verdict(Track(EngineState.SLOW, timeouts_in_a_row=timeouts), alert, alert)
    successes = track.successes_in_a_row + 1
    ok = f"probe ok in {result.seconds * 1000:.0f} ms"
    if track.state is EngineState.DOWN and successes < limits.up_after_successes:
        return Verdict(
            Track(EngineState.DOWN, successes_in_a_row=successes),
            f"{ok} ({successes}/{limits.up_after_successes} to recover)",
        )
    return Verdict(Track(EngineState.UP, successes_in_a_row=successes), ok)


# What a request meets on a kept-alive connection the server closed at that very moment.
CLOSED_UNDER_US = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


async def probe(client: httpx.AsyncClient, url: str, timeout_s: float) -> ProbeResult:
    """One liveness probe; a timeout is reported as such, never as a failure."""
    started = time.monotonic()
    try:
        with anyio.fail_after(timeout_s):
            try:
                response = await client.get(url)
            except CLOSED_UNDER_US:
                # The pooled connection was closed by the engine's keep-alive timer as the probe
                # went out (uvicorn, so vLLM and SGLang, closes idle connections after 5 s, the
                # default probe interval): the engine never read the probe. Ask once more, on a
                # connection of its own; a dead engine fails that one too.
                async with httpx.AsyncClient(timeout=timeout_s) as fresh:
                    response = await fresh.get(url)
    except TimeoutError:
        return ProbeResult(
            "timeout", f"no answer within {timeout_s:g}s", time.monotonic() - started
        )
    except httpx.HTTPError as exc:
        return ProbeResult(
            "failed", f"{type(exc).__name__}: {exc}".rstrip(": "), time.monotonic() - started
        )
    seconds = time.monotonic() - started
    if response.status_code >= 500:
        return ProbeResult("failed", f"HTTP {response.status_code}", seconds)
    if response.status_code >= 400:
        return ProbeResult("failed", f"HTTP {response.status_code} from health endpoint", seconds)
    return ProbeResult("ok", f"HTTP {response.status_code}", seconds)


@dataclass(slots=True)
class Prober:
    """Probes one endpoint forever at its lane's interval; ``report`` applies each verdict."""

    url: str
    interval_s: float
    timeout_s: float
    limits: Thresholds
    progressing: Callable[[], bool]
    report: Callable[[Verdict], None]
    # The endpoint's state in the pool: an ejection by real requests (engine_pool/outlier.py)
    # happens between probes, and recovery from it takes the same successes in a row.
    pool_state: Callable[[], EngineState] = lambda: EngineState.UP
    track: Track = Track()

    async def run(self, client: httpx.AsyncClient) -> None:
        while True:
            result = await probe(client, self.url, self.timeout_s)
            if self.pool_state() is EngineState.DOWN and self.track.state is not EngineState.DOWN:
                self.track = Track(EngineState.DOWN)
            verdict = judge(self.track, result, self.progressing(), self.limits)
            self.track = verdict.track
            self.report(verdict)
            # A probe that took its whole timeout does not shorten the next interval to nothing.
            await anyio.sleep(max(self.interval_s - result.seconds, self.interval_s / 4))
