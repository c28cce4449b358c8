"""Fault injection for one simulated engine: what is broken now, and a seeded dice for rates.

A ``FaultSpec`` is a value (set at start with ``--faults`` or the profile, replaced at run time
with ``POST /sim/faults``; ``{}`` clears everything):

    crash               stop listening (connection refused) and reset every open connection;
                        ``restart_after_s`` brings the listener back after that many seconds
    hang                accept connections and read requests, never answer (``/sim/*`` still works)
    dead                the engine core died, as vLLM 0.32 shows it: running requests end (a
                        stream with an error event and ``[DONE]``, a non-streamed one with 500),
                        new generations answer 500, ``GET /health`` still answers 200; after
                        ``exit_after_s`` (0.5 s) the server exits (connection refused), and
                        ``restart_after_s`` brings it back healthy after that many seconds
    first_byte_delay_s  hold the response (headers included) this long before the first byte
    stall_after_tokens  a stream stops sending after this many tokens, for ``stall_for_s``
                        seconds, or for ever when that is unset
    error_500_rate      this fraction of generation requests answers 500 at once
    error_429_rate      this fraction answers 429 (with ``Retry-After: 1``)
    drop_after_chunks   a stream's TCP connection is cut after this many SSE chunks

Fault durations are wall-clock seconds (they exercise the gateway's real deadlines), unlike the
engine's simulated timings. ``FaultState.injected`` counts what was injected, by kind.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class FaultError(ValueError):
    """A fault specification is invalid; the message names the key."""


class FaultSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    crash: bool = False
    restart_after_s: float | None = Field(None, gt=0)
    hang: bool = False
    dead: bool = False
    exit_after_s: float = Field(0.5, gt=0)
    first_byte_delay_s: float = Field(0.0, ge=0)
    stall_after_tokens: int | None = Field(None, ge=0)
    stall_for_s: float | None = Field(None, gt=0)
    error_500_rate: float = Field(0.0, ge=0, le=1)
    error_429_rate: float = Field(0.0, ge=0, le=1)
    drop_after_chunks: int | None = Field(None, ge=0)

    @classmethod
    def parse(cls, data: Any) -> FaultSpec:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            where = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'faults'}: {e['msg']}"
                for e in exc.errors()
            )
            raise FaultError(f"invalid faults: {where}") from exc


def parse_fault_arg(text: str) -> FaultSpec:
    """``--faults`` value: a JSON object, or ``name[=value],...`` (a bare name means true)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            return FaultSpec.parse(orjson.loads(text))
        except orjson.JSONDecodeError as exc:
            raise FaultError(f"--faults is not valid JSON: {exc}") from exc
    data: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        data[name.strip()] = value.strip() if sep else True
    return FaultSpec.parse(data)


InjectedError = Literal[500, 429]


class FaultState:
    """The faults of one engine right now; mutable, owned by the engine's server."""

    def __init__(self, spec: FaultSpec | None = None, seed: int | None = None) -> None:
        self.spec = spec or FaultSpec()
        self.injected: Counter[str] = Counter()
        self._rng = random.Random(seed)

    def set(self, spec: FaultSpec) -> None:
        self.spec = spec

    def draw_error(self) -> InjectedError | None:
        """Roll the dice for one generation request."""
        roll = self._rng.random()
        if roll < self.spec.error_500_rate:
            self.injected["error_500"] += 1
            return 500
        if roll < self.spec.error_500_rate + self.spec.error_429_rate:
            self.injected["error_429"] += 1
            return 429
        return None

    def as_dict(self) -> dict[str, Any]:
        return {
            "faults": self.spec.model_dump(exclude_defaults=True),
            "injected": dict(self.injected),
        }
