"""What a live request spends outside the engine's steps, as the what-if replay models it.

Measured by playing traces live through ``shapegate demo`` (``shapegate bench fidelity``,
``gateway/tuning/live_replay.py``): the per-request gateway and HTTP cost is milliseconds of wall
time, not microseconds, and it does not shrink with the engines' time scale. At time scale 0.05 a
4 ms hop is 80 ms of engine time, which is what made live small-request TTFT p50 read 1.42x the
prediction before the replay modelled it.

``LiveCosts`` holds those costs in wall seconds and converts them to the engines' clock
(``to_engine``: wall / time scale). ``gateway/tuning/fleet_sim.py`` applies them where the live path
pays them:

1. client send -> the gateway's admission: ``gateway_s`` (HTTP in, parse, count) plus
   ``per_mtoken_s`` x prompt tokens / 2 (the gateway's half of counting and copying the body).
   That work runs on the gateway's one event loop, so a burst queues for it: ``gateway_times``
   serves arrivals one at a time (measured live: the first request of a 50-request burst
   reached its engine in ~5 ms, the last ones in tens);
2. admission -> the engine stamps the arrival: ``forward_s`` (pick, HTTP hop, the engine's own
   parse and count) plus the other half of the per-token cost; the engine's queue starts then;
3. each token the engine emits reaches the client ``relay_s`` later; the request holds its slot
   and its endpoint's in-flight count until the relay of its last token ends;
4. the picker breaks in-flight ties on each engine's ``waiting`` count as last scraped, refreshed
   every ``HealthSettings.scrape_interval_s`` of wall time (``scrape_every``).

All pure: plain numbers in, plain numbers out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class LiveCosts:
    """Wall-clock costs of the live path; ``time_scale`` is the engines' (wall = engine x S).

    Defaults are what ``shapegate bench fidelity`` measured on the 2-core dev machine at load
    average ~2 (README, "Replay you can trust"; fitted by ``live_measure``: gateway 6.7 ms,
    hop 6.4 ms, relay 5.6 ms, 117 ms per million prompt tokens); ``LiveCosts.none()`` is the
    engines alone (the replay before it modelled the live path)."""

    time_scale: float = 1.0
    gateway_s: float = 0.007
    forward_s: float = 0.006
    relay_s: float = 0.0055
    per_mtoken_s: float = 0.12
    model_scrape: bool = True

    def __post_init__(self) -> None:
        if self.time_scale <= 0:
            raise ValueError("time_scale must be positive")
        for name in ("gateway_s", "forward_s", "relay_s", "per_mtoken_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")

    @classmethod
    def none(cls, time_scale: float = 1.0) -> LiveCosts:
        """No cost outside the engine and an always-fresh picker: the engine alone."""
        return cls(time_scale, 0.0, 0.0, 0.0, 0.0, model_scrape=False)

    def as_json(self) -> dict[str, Any]:
        """The costs as reports print them (milliseconds, rounded)."""
        return {
            "time_scale": self.time_scale,
            "gateway_ms": round(self.gateway_s * 1000, 3),
            "forward_ms": round(self.forward_s * 1000, 3),
            "relay_ms": round(self.relay_s * 1000, 3),
            "per_mtoken_ms": round(self.per_mtoken_s * 1000, 1),
            "model_scrape": self.model_scrape,
        }

    def to_engine(self, wall_s: float) -> float:
        """Wall seconds as seconds of the engines' clock."""
        return wall_s / self.time_scale

    def _counting(self, prompt_tokens: int) -> float:
        return self.per_mtoken_s * prompt_tokens / 1e6 / 2

    def to_gateway(self, prompt_tokens: int) -> float:
        """Engine seconds from the client's send to the gateway's admission."""
        return self.to_engine(self.gateway_s + self._counting(prompt_tokens))

    def to_engine_arrival(self, prompt_tokens: int) -> float:
        """Engine seconds from admission to the engine's own arrival stamp."""
        return self.to_engine(self.forward_s + self._counting(prompt_tokens))

    def gateway_times(self, arrivals: Sequence[tuple[float, int]]) -> list[float]:
        """When the gateway admits each of ``(send time, prompt tokens)``, on the engines'
        clock: one request at a time, in order of sending, through the gateway's own work."""
        free = -math.inf
        out = [0.0] * len(arrivals)
        for i in sorted(range(len(arrivals)), key=lambda i: arrivals[i][0]):
            at, tokens = arrivals[i]
            free = max(at, free) + self.to_gateway(tokens)
            out[i] = free
        return out

    def relay(self) -> float:
        """Engine seconds from a step's end to the client holding its token."""
        return self.to_engine(self.relay_s)

    def scrape_every(self, wall_interval_s: float) -> float | None:
        """Engine seconds between two scrapes of ``waiting``; None: the picker sees it live."""
        return self.to_engine(wall_interval_s) if self.model_scrape else None
