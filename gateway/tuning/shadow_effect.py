"""The predicted effect of a shadow policy: the live window replayed under both policies.

    predict_effect(active, shadow, trace, costs, small_below) -> dict

The live window (``request/shadow.py``'s report: the shapes of the requests both policies saw,
exact prompt tokens and the engines' output tokens, arrival times as they came) is played
through ``tuning/fleet_sim.py`` twice, once per policy, each cluster on its ``sim_profile``
engine, with the live path's costs (``tuning/fleet_model.py`` ``LiveCosts``: by default the
costs ``shapegate bench fidelity`` measured; the engines' time scale as given). Returned for
each policy: small-request TTFT p50/p95/p99 per lane and over every lane, monster completion
(p50 and max of the requests at or above ``small_below``), each lane's peak slots against its
limit, rejected requests; and the calibration used, stated. Both replays share the trace and
the costs, so their difference is the policies' (fleet_sim is deterministic).

Pure and CPU-bound (a few hundred milliseconds for thousands of requests): the admin route runs
it off the event loop. A cluster without ``sim_profile`` takes the other policy's cluster of the
same name's (the same engines); with neither it cannot be simulated: ``ValueError``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from engine_pool.sim.profile import EngineProfile
from gateway.observe.trace import TraceRecord
from gateway.settings import Settings
from gateway.tuning.fleet_model import LiveCosts
from gateway.tuning.fleet_result import SimulatedRequest
from gateway.tuning.fleet_sim import FleetSim
from gateway.tuning.replay import cluster_profiles, percentile, summarize

CALIBRATION = "shapegate bench fidelity: the live path's costs measured on this machine class"


def _round(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 4)


def _ttft(outcomes: Sequence[SimulatedRequest]) -> dict[str, float | None]:
    values = [o.ttft for o in outcomes if o.rejected is None and o.ttft is not None]
    return {
        "requests": len(outcomes),
        "ttft_p50": _round(percentile(values, 0.5)),
        "ttft_p95": _round(percentile(values, 0.95)),
        "ttft_p99": _round(percentile(values, 0.99)),
    }


def profiles_of(settings: Settings, like: Settings) -> dict[str, EngineProfile]:
    """Each cluster's simulated engine: its ``sim_profile``, else that of ``like``'s cluster of
    the same name (a candidate naming the running clusters without their profiles);
    ``ValueError`` naming the clusters that have neither."""
    named = {c.name: c.sim_profile for c in like.clusters if c.sim_profile}
    filled = settings.model_copy(
        update={
            "clusters": tuple(
                c if c.sim_profile else c.model_copy(update={"sim_profile": named.get(c.name)})
                for c in settings.clusters
            )
        }
    )
    return cluster_profiles(filled)


def effect_of(
    settings: Settings,
    profiles: dict[str, EngineProfile],
    trace: Sequence[TraceRecord],
    costs: LiveCosts,
    small_below: int,
) -> dict[str, Any]:
    """One policy's figures over the trace, in engine seconds."""
    result = FleetSim(settings, profiles, "tokens", costs).run(trace)
    summary = summarize("policy", settings, result, "tokens", small_below).summary
    small = [o for o in result.outcomes if o.prompt_tokens < small_below]
    monsters = [o for o in result.outcomes if o.prompt_tokens >= small_below]
    done = [o.e2e for o in monsters if o.rejected is None and o.e2e is not None]
    return {
        "small_ttft": _ttft(small),
        "small_ttft_by_lane": {
            lane: _ttft([o for o in small if o.lane == lane])
            for lane in sorted({o.lane for o in small})
        },
        "monster_completion": {
            "requests": len(monsters),
            "p50": _round(percentile(done, 0.5)),
            "max": _round(max(done, default=math.nan)),
        },
        "peak_slots": summary["slot_occupancy"],
        "rejected": summary["all"]["rejected"],
    }


def calibration(costs: LiveCosts) -> dict[str, Any]:
    return {"source": CALIBRATION, **costs.as_json()}


def predict_effect(
    active: Settings,
    shadow: Settings,
    trace: Sequence[TraceRecord],
    costs: LiveCosts,
    small_below: int = 32768,
) -> dict[str, Any]:
    """Both policies over the live window (arrivals in wall seconds from its start), in engine
    seconds: the window's times are divided by the engines' time scale, as ``replay --live``
    plays a trace at ``t x S``."""
    trace = [replace(r, t=r.t / costs.time_scale) for r in trace]
    return {
        "requests": len(trace),
        "span_s": round(trace[-1].t - trace[0].t, 3) if trace else 0.0,
        "small_below": small_below,
        "active": effect_of(active, profiles_of(active, shadow), trace, costs, small_below),
        "shadow": effect_of(shadow, profiles_of(shadow, active), trace, costs, small_below),
        "calibration": calibration(costs),
    }
