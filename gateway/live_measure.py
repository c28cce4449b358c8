"""The live path's costs, measured: what a played trace spent outside the engines' steps.

The player knows when it sent each request and when the first and last token reached it; a
simulated engine's ``/sim/requests`` knows, by the same ``X-Request-Id``, when the request
arrived there and when it emitted its first and last token (wall clock, ``*_wall``). So:

- ``pre``: send -> the engine's arrival stamp (gateway in, parse, count, admit, pick, HTTP hop,
  the engine's own parse and count). Its slope over prompt tokens gives ``per_mtoken_s``; the
  per-request cost is then fitted so that the replay's own model of it (``LiveCosts``: the
  gateway's work served one request at a time, ``gateway_times``) gives the measured median:
  the median itself would count a burst's queueing twice;
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
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from gateway.fleet_model import LiveCosts
from gateway.live_replay import Play, request_id
from gateway.replay import percentile


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


def _modelled_pre(costs: LiveCosts, sends: Sequence[tuple[float, int]]) -> float:
    admitted = costs.gateway_times(sends)
    return statistics.median(
        a - at + costs.to_engine_arrival(tokens)
        for a, (at, tokens) in zip(admitted, sends, strict=True)
    )


def _fit_hop(costs: LiveCosts, sends: Sequence[tuple[float, int]], target: float) -> LiveCosts:
    """The per-request cost (all of it the gateway's, served one at a time) whose modelled
    median send -> engine time is the measured one: bisection, it only grows with the cost."""
    low, high = 0.0, max(target, 0.0)
    for _ in range(40):
        mid = (low + high) / 2
        if _modelled_pre(dataclasses.replace(costs, gateway_s=mid), sends) < target:
            low = mid
        else:
            high = mid
    return dataclasses.replace(costs, gateway_s=(low + high) / 2)


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
    costs = _fit_hop(costs, sends, statistics.median(y for _, y in pre))
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
