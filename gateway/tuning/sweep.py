"""``shapegate replay --sweep KEY=V1,V2,...``: which value of one knob? One table, one plot.

    shapegate replay --config configs/demo.yaml burst.jsonl \\
        --sweep lanes.fast.max_prompt_tokens=8k,16k,32k,64k --out sweep-out/

Contract:
- ``parse_sweep("lanes.fast.max_prompt_tokens=8k,16k")`` -> ``Sweep``: a dotted key (a lane or
  cluster by its name, ``lanes.fast.slots.lane``; a model by its name too) and its candidate
  values, as YAML scalars with ``k`` (x1024) and ``m`` (x1024^2) for token counts: ``32k`` is
  32768. A malformed spec raises ``ValueError`` naming it.
- ``candidate(data, sweep, value)`` is the policy mapping with that one value set. A lane
  boundary moves with its neighbour: setting ``lanes.fast.max_prompt_tokens`` also sets the
  ``min_prompt_tokens`` of the lane that started where fast ended (and the reverse), so every
  candidate still covers the same prompts with no gap and no overlap.
- ``run_sweep(...)`` plays the trace through ``replay.simulate`` once per candidate (each
  validated as a policy first: an invalid candidate is a ``ConfigError`` naming its value), and
  returns one ``SweepRow`` per candidate; ``render_sweep`` and ``plot_sweep`` show them. Small
  and monster requests are split at a fixed ``small_below`` for every candidate, so the rows
  measure the same requests.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from engine_pool.sim.profile import EngineProfile
from gateway.extras import pyplot, save
from gateway.observe.trace import TraceRecord
from gateway.settings import ConfigError, parse_settings
from gateway.tuning.replay import SimReport, cluster_profiles, simulate

_SUFFIXES = {"k": 1024, "m": 1024 * 1024}
_NAMED_LISTS = ("lanes", "clusters", "models")


@dataclass(frozen=True, slots=True)
class Sweep:
    key: tuple[str, ...]
    values: tuple[Any, ...]
    labels: tuple[str, ...]

    @property
    def name(self) -> str:
        return ".".join(self.key)


@dataclass(frozen=True, slots=True)
class SweepRow:
    label: str
    value: Any
    report: SimReport


def _value(text: str) -> Any:
    raw = text.strip()
    suffix = raw[-1:].lower()
    if suffix in _SUFFIXES and raw[:-1].replace(".", "", 1).isdigit():
        return int(float(raw[:-1]) * _SUFFIXES[suffix])
    return yaml.safe_load(raw)


def parse_sweep(spec: str) -> Sweep:
    key, sep, values = spec.partition("=")
    parts = tuple(p for p in key.strip().split(".") if p)
    labels = tuple(v.strip() for v in values.split(",") if v.strip())
    if not sep or len(parts) < 2 or not labels:
        raise ValueError(
            f"--sweep {spec!r}: expected KEY=V1,V2,... such as "
            "lanes.fast.max_prompt_tokens=8k,16k,32k,64k"
        )
    return Sweep(parts, tuple(_value(v) for v in labels), labels)


def _container(data: Any, part: str, sweep: Sweep) -> Any:
    """One step down the key: a mapping's key, or a named list's item by its name."""
    if isinstance(data, list):
        for item in data:
            if isinstance(item, dict) and item.get("name") == part:
                return item
        names = ", ".join(str(i.get("name")) for i in data if isinstance(i, dict))
        raise ValueError(f"--sweep {sweep.name}: no {part!r} here (names: {names})")
    if not isinstance(data, dict) or (part not in data and part in _NAMED_LISTS):
        raise ValueError(f"--sweep {sweep.name}: the policy has no {part!r}")
    return data.setdefault(part, {})


def candidate(data: Mapping[str, Any], sweep: Sweep, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(dict(data))
    node: Any = out
    for part in sweep.key[:-1]:
        node = _container(node, part, sweep)
    if not isinstance(node, dict):
        raise TypeError(f"--sweep {sweep.name}: {'.'.join(sweep.key[:-1])} is not a mapping")
    field = sweep.key[-1]
    if sweep.key[0] == "lanes" and len(sweep.key) == 3 and field.endswith("_prompt_tokens"):
        _move_neighbour(out["lanes"], node, field, value)
    node[field] = value
    return out


def _move_neighbour(
    lanes: list[dict[str, Any]], lane: dict[str, Any], field: str, value: Any
) -> None:
    """Keep the boundary shared: the lane on the other side of it moves with it."""
    if field == "max_prompt_tokens":
        old = lane.get("max_prompt_tokens")
        for other in lanes:
            if other is not lane and other.get("min_prompt_tokens", 0) == old:
                other["min_prompt_tokens"] = value
    elif field == "min_prompt_tokens":
        old = lane.get("min_prompt_tokens", 0)
        for other in lanes:
            if other is not lane and other.get("max_prompt_tokens") == old:
                other["max_prompt_tokens"] = value


def run_sweep(
    data: Mapping[str, Any],
    sweep: Sweep,
    trace: Sequence[TraceRecord],
    *,
    small_below: int = 32768,
    profiles: Mapping[str, EngineProfile] | None = None,
    progress: Callable[[str], Any] | None = None,
) -> list[SweepRow]:
    rows = []
    for label, value in zip(sweep.labels, sweep.values, strict=True):
        try:
            settings = parse_settings(candidate(data, sweep, value))
        except ConfigError as exc:
            raise ConfigError(f"--sweep {sweep.name}={label}: {exc}") from exc
        report = simulate(
            label,
            settings,
            trace,
            profiles or cluster_profiles(settings),
            small_below=small_below,
            progress=progress(label) if progress else None,
        )
        rows.append(SweepRow(label, value, report))
    return rows


def _cells(row: SweepRow) -> dict[str, str]:
    s = row.report.summary
    small, large = s["small_requests"], s["large_requests"]
    peaks = " ".join(f"{lane} {p['peak']}/{p['limit']}" for lane, p in s["slot_occupancy"].items())
    return {
        "small TTFT p50 s": f"{small['ttft_p50']:.2f}",
        "small TTFT p99 s": f"{small['ttft_p99']:.2f}",
        "monster completion p50 s": f"{large['e2e_p50']:.2f}",
        "monster completion max s": f"{large['e2e_max']:.2f}",
        "monsters leaked": str(s["large_in_light_lane"]),
        "rejected": str(s["all"]["rejected"]),
        "slot peak/limit": peaks,
    }


def render_sweep(sweep: Sweep, rows: Sequence[SweepRow]) -> str:
    small_below = rows[0].report.summary["small_below"] if rows else 0
    header = [sweep.name, *_cells(rows[0])] if rows else [sweep.name]
    table = [header, *([row.label, *_cells(row).values()] for row in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = [
        "  ".join(
            c.rjust(w) if i else c.ljust(w)
            for i, (c, w) in enumerate(zip(line, widths, strict=True))
        )
        for line in table
    ]
    return (
        f"sweep of {sweep.name}: small = prompts under {small_below} tokens, monsters = the "
        "rest (the same requests in every row); leaked = monsters served in the lane of the "
        "shortest prompts\n" + "\n".join(lines)
    )


def plot_sweep(sweep: Sweep, rows: Sequence[SweepRow], path: Path) -> None:
    plt = pyplot()
    labels = [row.label for row in rows]
    x = list(range(len(rows)))
    summaries = [row.report.summary for row in rows]
    fig, (ax_small, ax_large, ax_slots) = plt.subplots(1, 3, figsize=(15, 4.5))
    for key, marker in (("ttft_p50", "o"), ("ttft_p99", "s")):
        ax_small.plot(
            x,
            [s["small_requests"][key] for s in summaries],
            marker=marker,
            label=key.replace("_", " "),
        )
    ax_small.set_yscale("log")
    ax_small.set_ylabel("seconds (log)")
    ax_small.set_title("small-request TTFT")
    ax_small.legend()
    ax_large.plot(
        x, [s["large_requests"]["e2e_p50"] for s in summaries], marker="o", label="completion p50"
    )
    ax_large.set_ylabel("seconds")
    ax_large.set_title("monsters: completion p50, and leaked (bars)")
    leaked = ax_large.twinx()
    leaked.bar(x, [s["large_in_light_lane"] for s in summaries], alpha=0.3, color="tab:red")
    leaked.set_ylabel("monsters leaked into the light lane")
    lanes = sorted({lane for s in summaries for lane in s["slot_occupancy"]})
    width = 0.8 / max(1, len(lanes))
    for i, lane in enumerate(lanes):
        ax_slots.bar(
            [v + i * width for v in x],
            [s["slot_occupancy"].get(lane, {}).get("peak", 0) for s in summaries],
            width,
            label=lane,
        )
    ax_slots.set_title("slot peak per lane (simulated)")
    ax_slots.legend()
    for ax in (ax_small, ax_large, ax_slots):
        ax.set_xticks(x, labels)
        ax.set_xlabel(sweep.name)
    save(fig, path)
