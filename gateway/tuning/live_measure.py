"""The live path's costs, measured: what a played trace spent outside the engines' steps.

The player knows when it sent each request and when the first and last token reached it; a
simulated engine's ``/sim/requests`` knows, by the same ``X-Request-Id``, when the request
arrived there and when it emitted its first and last token (wall clock, ``*_wall``). So:

- ``pre``: send -> the engine's arrival stamp (gateway in, parse, count, admit, pick, HTTP hop,
  the engine's own parse and count). Its slope over prompt tokens gives ``per_mtoken_s``; the
  per-request cost is then fitted so that the replay's own model of it (``LiveCosts``: the
  gateway's part served one request at a time, ``gateway_times``, the hop's in parallel) gives
  the measured median and 90th percentile: the median alone, taken as a cost, would count a
  burst's queueing twice and miss its tail;
- ``relay``: the end of the step that made the first token, where the engine's clock puts it
  (``arrived_wall - arrived_s x S + first_token_s x S``), -> the client has it (the median).
  Measured from the step's end rather than from the engine's ``first_token_wall`` it includes
  the engine's own late delivery when its event loop falls behind, which the cost model of its
  steps does not see.

``fetch_engine_records(urls)`` is the I/O; ``measure(plays, records, time_scale)`` is pure and
returns ``Measured`` (the costs and the figures behind them, wall milliseconds).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from gateway.tuning.fleet_model import LiveCosts
from gateway.tuning.live_replay import Play, request_id
from gateway.tuning.replay import percentile


@dataclass(frozen=True, slots=True)
class Measured:
    costs: LiveCosts
    requests: int
    pre_ms_p50: float
    pre_ms_p99: float
    relay_ms_p50: float
    per_mtoken_ms: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "pre_engine_ms_p50": round(self.pre_ms_p50, 2),
            "pre_engine_ms_p99": round(self.pre_ms_p99, 2),
            "relay_ms_p50": round(self.relay_ms_p50, 2),
            "per_mtoken_ms": round(self.per_mtoken_ms, 1),
        }


async def fetch_engine_records(urls: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Every simulated engine's records, by request id (the last one where an id repeats)."""
    found: dict[str, dict[str, Any]] = {}
    async with httpx.AsyncClient(timeout=30) as client:
        for url in urls:
            response = await client.get(url.rstrip("/") + "/sim/requests")
            response.raise_for_status()
            for record in response.json()["requests"]:
                found[record["request_id"]] = record
    return found


def _fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``y = a + b x``; a flat line through the median when x does not vary."""
    xs = [x for x, _ in points]
    if len(points) < 3 or max(xs) - min(xs) < 1e4:
        return statistics.median(y for _, y in points), 0.0
    slope, intercept = statistics.linear_regression(xs, [y for _, y in points])
    return intercept, max(0.0, slope)


def _modelled_pre(costs: LiveCosts, sends: Sequence[tuple[float, int]]) -> list[float]:
    admitted = costs.gateway_times(sends)
    return [
        a - at + costs.to_engine_arrival(tokens)
        for a, (at, tokens) in zip(admitted, sends, strict=True)
    ]


def _fit_split(
    costs: LiveCosts, sends: Sequence[tuple[float, int]], median: float, p90: float
) -> LiveCosts:
    """The per-request cost split in two, the gateway's part (served one request at a time,
    so a burst queues for it) and the hop's (paid in parallel), whose modelled send -> engine
    times have the measured median and 90th percentile: a grid over the gateway's part, the
    hop's part then set to match the median."""
    best, best_error = costs, math.inf
    for step in range(61):
        gateway = max(median, 0.0) * step / 60
        trial = dataclasses.replace(costs, gateway_s=gateway, forward_s=0.0)
        modelled = _modelled_pre(trial, sends)
        forward = max(0.0, median - statistics.median(modelled))
        shifted = [m + forward for m in modelled]
        error = abs(percentile(shifted, 0.9) - p90) + abs(statistics.median(shifted) - median)
        if error < best_error:
            best, best_error = dataclasses.replace(trial, forward_s=forward), error
    return best


def measure(
    plays: Sequence[Play], records: Mapping[str, Mapping[str, Any]], time_scale: float
) -> Measured | None:
    """The costs seen in a play (None when no engine record matches a served request)."""
    pre: list[tuple[float, float]] = []
    relay: list[float] = []
    for item in plays:
        record = records.get(request_id(item.index))
        if record is None or item.sent is None or item.status != 200:
            continue
        pre.append(
            (item.record.prompt_tokens, record["arrived_wall"] - item.origin_epoch - item.sent)
        )
        first_s = record.get("first_token_s")
        if first_s is not None and item.first_token is not None:
            engine_t0 = record["arrived_wall"] - record["arrived_s"] * time_scale
            step_end = engine_t0 + first_s * time_scale
            relay.append(item.origin_epoch + item.first_token - step_end)
    if not pre:
        return None
    _, slope = _fit(pre)
    sends = [
        (item.sent, item.record.prompt_tokens)
        for item in plays
        if item.sent is not None and request_id(item.index) in records and item.status == 200
    ]
    costs = LiveCosts(
        time_scale=1.0,  # wall seconds throughout the fit
        gateway_s=0.0,
        forward_s=0.0,
        relay_s=max(0.0, statistics.median(relay)) if relay else LiveCosts().relay_s,
        per_mtoken_s=slope * 1e6,
    )
    delays = [y for _, y in pre]
    costs = _fit_split(costs, sends, statistics.median(delays), percentile(delays, 0.9))
    costs = dataclasses.replace(costs, time_scale=time_scale)
    values = [y * 1000 for _, y in pre]
    return Measured(
        costs,
        len(pre),
        percentile(values, 0.5),
        percentile(values, 0.99),
        statistics.median(relay) * 1000 if relay else float("nan"),
        slope * 1e9,
    )
