"""The rules between the keys of a policy, each problem tied to the key at fault. Pure.

``policy_problems(settings)`` returns ``Problem(key, message)`` for:
- names: clusters, lanes, and model names with their aliases are unique; lanes and clusters name
  clusters and models that exist; no cluster is both a lane's primary and its emergency;
- lane ranges: the lowest lane starts at 0 and the ranges leave no gap and no overlap, so every
  prompt up to the highest lane's ``max_prompt_tokens`` has exactly one lane (above it, a prompt
  is refused with 400: the one rule for the rest);
- slots: a lane's ``slots.per_endpoint`` is at most its ``slots.lane``;
- emergencies: a lane's emergency clusters serve every model its primaries serve.

``Settings`` runs these in its own validator (messages joined, no lines); ``config_check`` runs them
with the file's line marks. Environment variables are ``config_check``'s, not these rules'.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.settings import Settings

Key = tuple[str | int, ...]


@dataclass(frozen=True, slots=True)
class Problem:
    key: Key
    message: str

    def __str__(self) -> str:
        return f"{'.'.join(str(p) for p in self.key)}: {self.message}"


def policy_problems(settings: Settings) -> list[Problem]:
    names = list(_names(settings))
    # The other rules look clusters and models up by name: only once every name resolves.
    if names:
        return names
    return [*_coverage(settings), *_slot_limits(settings), *_emergencies(settings)]


def _duplicates(values: Iterable[str]) -> list[int]:
    seen: set[str] = set()
    repeated = []
    for index, value in enumerate(values):
        if value in seen:
            repeated.append(index)
        seen.add(value)
    return repeated


def _names(settings: Settings) -> Iterable[Problem]:
    for index in _duplicates(c.name for c in settings.clusters):
        yield Problem(("clusters", index, "name"), "cluster names must be unique")
    for index in _duplicates(lane.name for lane in settings.lanes):
        yield Problem(("lanes", index, "name"), "lane names must be unique")
    seen: set[str] = set()
    for index, model in enumerate(settings.models):
        for name in (model.name, *model.aliases):
            if name in seen:
                yield Problem(("models", index), f"model name or alias {name!r} is used twice")
            seen.add(name)
    known = {c.name for c in settings.clusters}
    for index, lane in enumerate(settings.lanes):
        for field in ("clusters", "emergency_clusters"):
            for position, cluster in enumerate(getattr(lane, field)):
                if cluster not in known:
                    yield Problem(
                        ("lanes", index, field, position),
                        f"unknown cluster {cluster!r} (clusters: {', '.join(sorted(known))})",
                    )
        if set(lane.clusters) & set(lane.emergency_clusters):
            yield Problem(
                ("lanes", index, "emergency_clusters"),
                "a cluster is both primary and emergency",
            )
    for index, spec in enumerate(settings.clusters):
        for position, model_name in enumerate(spec.models):
            if model_name not in seen:
                yield Problem(
                    ("clusters", index, "models", position), f"unknown model {model_name!r}"
                )


def _coverage(settings: Settings) -> Iterable[Problem]:
    ordered = sorted(enumerate(settings.lanes), key=lambda item: item[1].min_prompt_tokens)
    index, first = ordered[0]
    if first.min_prompt_tokens > 0:
        yield Problem(
            ("lanes", index, "min_prompt_tokens"),
            f"gap: no lane takes prompts below {first.min_prompt_tokens} tokens (the lowest "
            "lane must start at 0)",
        )
    for (_, low), (index, high) in itertools.pairwise(ordered):
        if high.min_prompt_tokens > low.max_prompt_tokens:
            yield Problem(
                ("lanes", index, "min_prompt_tokens"),
                f"gap: no lane takes prompts of {low.max_prompt_tokens} to "
                f"{high.min_prompt_tokens - 1} tokens (lane {low.name!r} ends below "
                f"{low.max_prompt_tokens}, lane {high.name!r} starts at {high.min_prompt_tokens})",
            )
        elif high.min_prompt_tokens < low.max_prompt_tokens:
            upper = min(low.max_prompt_tokens, high.max_prompt_tokens) - 1
            yield Problem(
                ("lanes", index, "min_prompt_tokens"),
                f"overlap: lanes {low.name!r} and {high.name!r} both take prompts of "
                f"{high.min_prompt_tokens} to {upper} tokens",
            )


def _slot_limits(settings: Settings) -> Iterable[Problem]:
    for index, lane in enumerate(settings.lanes):
        if lane.slots.per_endpoint > lane.slots.lane:
            yield Problem(
                ("lanes", index, "slots", "per_endpoint"),
                f"{lane.slots.per_endpoint} is above the lane's limit (slots.lane) of "
                f"{lane.slots.lane}: no endpoint could ever hold that many",
            )


def _served(settings: Settings, cluster: str) -> set[str]:
    names = settings.cluster(cluster).models
    if not names:
        return {m.name for m in settings.models}
    return {model.name for n in names if (model := settings.model(n)) is not None}


def _emergencies(settings: Settings) -> Iterable[Problem]:
    for index, lane in enumerate(settings.lanes):
        if not lane.emergency_clusters:
            continue
        needed = set().union(*(_served(settings, c) for c in lane.clusters))
        covered = set().union(*(_served(settings, c) for c in lane.emergency_clusters))
        missing = sorted(needed - covered)
        if missing:
            yield Problem(
                ("lanes", index, "emergency_clusters"),
                f"no emergency cluster serves {', '.join(missing)}, which the lane's primary "
                "clusters serve: with the primaries down those requests would fail",
            )
