"""Count drift: our exact prompt count against the engine's own ``usage.prompt_tokens``.

A wrong tokenizer or chat template in the policy (the built-in ChatML counts 2 tokens fewer than
Qwen3.6's own template, which opens the assistant turn with ``<think>``) shows up here the
moment traffic flows, instead of as lanes decided on counts that are quietly off.

Contract:
- ``DriftWatch.observe(model=..., route=..., ours=..., theirs=..., tokenizer=..., template=...)``
  whenever both counts exist: drift is ``theirs - ours`` (positive: the engine saw more tokens
  than we counted), observed into ``shapegate_count_drift_tokens{model, route}`` (``model`` is
  the policy's model name, ``route`` the API route, ``chat`` or ``completions``: labels the
  policy bounds). A non-zero drift logs ``count.drift`` (warning: model, tokenizer, template,
  route, ours, theirs, drift) at most once per ``warn_every_s`` per model and route; the line
  carries how many drifted requests went unlogged since the last one.
- ``as_json()`` is the dashboard's badge: per model and route, requests compared, how many
  drifted, and the last drift seen with both counts.
- Memory: one small record per model and route.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.observe.log import Logger
from gateway.observe.metrics import Metrics


@dataclass(slots=True)
class _Seen:
    tokenizer: str
    template: str
    compared: int = 0
    drifted: int = 0
    last_drift: int = 0
    last_ours: int = 0
    last_theirs: int = 0
    warned_at: float | None = None
    unlogged: int = 0


class DriftWatch:
    def __init__(
        self,
        metrics: Metrics,
        log: Logger,
        warn_every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._metrics = metrics
        self._log = log
        self._warn_every_s = warn_every_s
        self._clock = clock
        self._seen: dict[tuple[str, str], _Seen] = {}

    def observe(
        self, *, model: str, route: str, ours: int, theirs: int, tokenizer: str, template: str
    ) -> int:
        drift = theirs - ours
        self._metrics.child(self._metrics.count_drift, model, route).observe(drift)
        seen = self._seen.get((model, route))
        if seen is None:
            seen = self._seen[(model, route)] = _Seen(tokenizer, template)
        seen.tokenizer, seen.template = tokenizer, template
        seen.compared += 1
        if drift == 0:
            return 0
        seen.drifted += 1
        seen.last_drift, seen.last_ours, seen.last_theirs = drift, ours, theirs
        now = self._clock()
        if seen.warned_at is not None and now - seen.warned_at < self._warn_every_s:
            seen.unlogged += 1
            return drift
        self._log.warning(
            "count.drift",
            model=model,
            tokenizer=tokenizer,
            template=template,
            route=route,
            ours=ours,
            theirs=theirs,
            drift=drift,
            unlogged_since_last=seen.unlogged,
        )
        seen.warned_at, seen.unlogged = now, 0
        return drift

    def as_json(self) -> list[dict[str, Any]]:
        return [
            {
                "model": model,
                "route": route,
                "tokenizer": seen.tokenizer,
                "template": seen.template,
                "compared": seen.compared,
                "drifted": seen.drifted,
                "last_drift": seen.last_drift if seen.drifted else None,
                "last_ours": seen.last_ours if seen.drifted else None,
                "last_theirs": seen.last_theirs if seen.drifted else None,
            }
            for (model, route), seen in sorted(self._seen.items())
        ]
