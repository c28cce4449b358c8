"""Priority classes inside a lane: pure rules shared by the live gateway
(gateway/request/admission.py, gateway/request/want.py) and the what-if replay
(gateway/tuning/fleet_sim.py).

    class_of(classes, key_digest, header) -> str     the request's class (400 on an unknown name)
    next_waiter(waiting, now, starvation_s) -> int   which queued request goes next
    passing(ahead) -> frozenset[str] | None          may a waiter go past those ahead of it
    class_lane_limit(classes, name, lane_slots)      lane slots a class may fill (reserved shares)
    retry_after_s(depth, drain_per_s, ceiling_s)     Retry-After from the measured drain rate
    DrainMeter                                       grants per second over a sliding window

- A key named in ``classes.api_keys`` gets that class; any other gets ``classes.default``. The
  header may name a lower class (a client marking its own batch work), never a higher one: a
  higher name is ignored and the key's class kept.
- The queue goes by class (highest first), then arrival; but a request that has waited
  ``starvation_s`` goes before every class (the oldest such first), so a flood of a higher class
  delays a lower one by at most that bound plus one slot's turn.
- In a lane with ``prefix_hold_tokens`` (a request may wait for its full home endpoint,
  engine_pool/chain.py ``_hold``), a waiter holding for its home does not hold the queue: a
  waiter behind it may take an endpoint with room once every waiter ahead of it has tried and
  found none, never one they wait for (``passing``), at most ``PASS_AHEAD`` places from the head.
- ``reserved: {interactive: 0.25}`` keeps a quarter of each lane's slots (rounded up) for
  ``interactive`` and the classes above it: a lower class may fill only the rest.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Sequence

from gateway.settings import ClassSettings


class UnknownClass(ValueError):
    pass


def rank(classes: ClassSettings, name: str) -> int:
    """0 for the highest class."""
    return classes.names.index(name)


def bearer_digest(authorization: bytes | None) -> str | None:
    """The SHA-256 hex digest of a ``Bearer`` key, as ``classes.api_keys`` lists keys."""
    scheme, _, key = (authorization or b"").partition(b" ")
    if scheme.lower() != b"bearer" or not key.strip():
        return None
    return hashlib.sha256(key.strip()).hexdigest()


def class_of(classes: ClassSettings, key_digest: str | None, header: str | None) -> str:
    keyed = classes.api_keys.get(key_digest, classes.default) if key_digest else classes.default
    if header is None or not header.strip():
        return keyed
    asked = header.strip().lower()
    if asked not in classes.names:
        raise UnknownClass(
            f"unknown priority class {asked!r} in {classes.header} (classes: "
            f"{', '.join(classes.names)})"
        )
    # Only ever lower: the key decides how high a request may go.
    return asked if rank(classes, asked) >= rank(classes, keyed) else keyed


def next_waiter(waiting: Sequence[tuple[int, float]], now: float, starvation_s: float) -> int:
    """Index of the waiter to serve next. ``waiting`` is (class rank, arrival time) in arrival
    order; the caller guarantees it is not empty."""
    for index, (_, since) in enumerate(waiting):
        if now - since >= starvation_s:
            return index  # the oldest of those starved past the bound
    return min(range(len(waiting)), key=lambda i: (waiting[i][0], i))


# How far behind the head a waiter may pass holding waiters (each pass is a try of the store).
PASS_AHEAD = 8


def passing(ahead: Sequence[frozenset[str] | None]) -> frozenset[str] | None:
    """May a waiter try the store before those ahead of it (``ahead``: for each, head first,
    the endpoints it asked for and found full at its last try, None if it has not tried since
    joining)? Only when each of them has tried and is holding, and it stands at most
    ``PASS_AHEAD`` places behind the head: then the endpoints they hold for, which it must not
    take (None: it waits its turn). The head passes nobody: ``passing([])`` is empty."""
    if len(ahead) > PASS_AHEAD or any(wants is None for wants in ahead):
        return None
    return frozenset().union(*(w for w in ahead if w is not None))


def class_lane_limit(classes: ClassSettings, name: str, lane_slots: int) -> int:
    """Lane slots a request of class ``name`` may fill: all but those reserved for higher
    classes (shares rounded up), at least one."""
    if not classes.reserved:  # the default: nothing to rank (every admission asks)
        return max(1, lane_slots)
    mine = rank(classes, name)
    kept = sum(
        math.ceil(share * lane_slots)
        for other, share in classes.reserved.items()
        if rank(classes, other) < mine
    )
    return max(1, lane_slots - kept)


def retry_after_s(depth: int, drain_per_s: float, ceiling_s: float) -> float:
    """Seconds until a request joining behind ``depth`` others would be let in, at the measured
    drain rate; ``ceiling_s`` when nothing drained lately (no evidence of progress). At least 1."""
    if drain_per_s <= 0:
        return max(1.0, ceiling_s)
    return max(1.0, min(ceiling_s, (depth + 1) / drain_per_s))


class DrainMeter:
    """How fast a lane's queue drains: grants over the last ``window_s`` seconds."""

    __slots__ = ("_times", "window_s")

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._times: deque[float] = deque()

    def granted(self, now: float) -> None:
        self._times.append(now)
        self._trim(now)

    def rate(self, now: float) -> float:
        self._trim(now)
        if not self._times:
            return 0.0
        # Over the time actually observed (a young meter is not diluted by the whole window).
        span = max(1.0, min(self.window_s, now - self._times[0]))
        return len(self._times) / span

    def _trim(self, now: float) -> None:
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()


def explain(classes: ClassSettings) -> list[str]:
    """The classes in words (``shapegate check-config``)."""
    keyed = len(classes.api_keys)
    reserved = ", ".join(f"{name} {share:.0%}" for name, share in classes.reserved.items())
    return [
        f"priority classes (highest first): {', '.join(classes.names)}; default "
        f"{classes.default}; {keyed} API key(s) mapped; header {classes.header} may only lower "
        "a key's class",
        f"  each lane's queue: class, then arrival; nobody waits past {classes.starvation_s:g}s "
        f"behind a higher class; reserved slot shares: {reserved or 'none'}",
    ]
