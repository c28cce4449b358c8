"""Passive health: what real requests say about an endpoint, between probes. Pure.

    judge_failure(failures, threshold, refused, others_routable) -> bool   eject now?
    ramp(since, window_s, now) -> float                                     slow-start share

A request that cannot reach its engine (refused, reset, closed before any answer byte) is
evidence the prober would only find at its next interval: ``eject_after_connect_failures`` of
them in a row (or ``eject_after_5xx`` 5xx answers in a row, when set) take the endpoint out of
routing at once. The cap: the last routable endpoint of a cluster is only ejected when it
refuses connections (truly gone); a flaky or erroring last endpoint stays routable, since
ejecting it would turn every request of the cluster into an error.

An endpoint that joins or comes back is ramped: its per-endpoint slot limit is multiplied by
``ramp`` (at least one slot), from near 0 to 1 over the cluster's ``slow_start_s``, so a burst
queued behind a dead engine does not land all at once on a freshly started one.
"""

from __future__ import annotations

import math


def judge_failure(failures: int, threshold: int, *, refused: bool, others_routable: int) -> bool:
    """Whether ``failures`` consecutive failures (the last one ``refused`` or not) eject;
    a ``threshold`` of 0 never does."""
    if threshold <= 0 or failures < threshold:
        return False
    return others_routable > 0 or refused


def ramp(since: float | None, window_s: float, now: float) -> float:
    """The share of its slot limit an endpoint warming up since ``since`` may use, in (0, 1]."""
    if since is None or window_s <= 0:
        return 1.0
    return min(1.0, max(0.0, now - since) / window_s)


def ramped_limit(limit: int, share: float) -> int:
    """A per-endpoint limit scaled by a slow-start share: at least 1, at most ``limit``."""
    if share >= 1.0:  # the usual case (no slow start): the limit itself, without the float
        return limit if limit > 1 else 1
    return max(1, min(limit, math.ceil(limit * share)))
