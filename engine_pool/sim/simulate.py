"""Run the scheduler over a list of arrivals in pure simulated time: no sleeping, no asyncio.

``simulate(profile, arrivals)`` steps the same ``Scheduler`` the live engine uses, jumping the
clock from one step's end to the next (or to the next arrival when idle), and returns one
``Timeline`` per request: arrival, first token, finish, all in simulated seconds. Calibration
tests and what-if benchmarks use it; a 3-minute prefill costs microseconds to simulate.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine_pool.sim.profile import EngineProfile
from engine_pool.sim.scheduler import Scheduler, StepResult


@dataclass(frozen=True, slots=True)
class Arrival:
    key: str
    at: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class Timeline:
    key: str
    prompt_tokens: int
    output_tokens: int
    arrival: float
    first_token: float
    finished: float

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def decode_tokens_per_s(self) -> float:
        """Output rate after the first token (what a user watching the stream sees)."""
        if self.output_tokens < 2:
            return float("inf")
        return (self.output_tokens - 1) / (self.finished - self.first_token)


@dataclass(frozen=True, slots=True)
class Simulation:
    timelines: dict[str, Timeline]
    steps: tuple[StepResult, ...]


def simulate(profile: EngineProfile, arrivals: Iterable[Arrival]) -> Simulation:
    scheduler = Scheduler(profile.scheduler, profile.costs)
    pending = sorted(arrivals, key=lambda a: a.at)
    by_key = {a.key: a for a in pending}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    steps: list[StepResult] = []
    clock = 0.0
    i = 0
    while i < len(pending) or scheduler.has_work:
        while i < len(pending) and pending[i].at <= clock:
            a = pending[i]
            scheduler.add(a.key, a.prompt_tokens, a.output_tokens, a.at)
            i += 1
        result = scheduler.step(clock)
        if result is None:
            clock = pending[i].at  # idle: jump to the next arrival
            continue
        steps.append(result)
        clock = result.end
        for key in result.first_tokens:
            first[key] = clock
        for key in result.finished:
            done[key] = clock
    timelines = {
        key: Timeline(
            key=key,
            prompt_tokens=a.prompt_tokens,
            output_tokens=a.output_tokens,
            arrival=a.at,
            first_token=first[key],
            finished=done[key],
        )
        for key, a in by_key.items()
    }
    return Simulation(timelines=timelines, steps=tuple(steps))
