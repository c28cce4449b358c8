"""The gateway-wide view of N workers, merged from each worker's own: pure functions over the
Prometheus text and the JSON states the workers serve (gateway/edge/peers.py fetches them).

Contract:
- ``merge_metrics(texts)``: every series summed across workers (counters, histograms, and the
  gauges that count things each worker holds: slots in use, queue depth, in-flight), except
  the gauges every worker sets to the same gateway-wide value (``SAME_EVERYWHERE``: limits,
  engine health and load each worker probes itself, build info, store degraded), which take
  the maximum, and ``*_created`` timestamps, which take the earliest. Adds
  ``shapegate_workers{state="configured"|"answered"}``.
- ``merge_admin_state`` and ``merge_dashboard``: the first state is this worker's and gives
  what the shared slot store already counts for all (lane and endpoint slots in use) and what
  is the same everywhere (policy, limits, engine health); queues, in-flight and the rolling
  window's rates and outcome counts are summed, oldest waits taken at the maximum, the newest
  decisions interleaved by time. Percentiles cannot be merged from percentiles: the merged
  p50/p95/p99 are the highest of the workers' (an upper bound), with ``n`` summed.
  ``workers`` lists each worker's index, pid, in-flight, accepting and policy version.
  Each worker keeps its own prefix index (gateway/request/prefix.py): the merged
  ``prefix_index`` sums their entries, bounds, evictions and each endpoint's blocks (the
  gateway's memory holds them all), and takes the highest oldest age and KV-events lag.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Metric, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

SAME_EVERYWHERE = frozenset(
    {
        "shapegate_slots_limit",
        "shapegate_build_info",
        "shapegate_engine_up",
        "shapegate_engine_load",
        "shapegate_engine_slow",
        "shapegate_state_degraded",
    }
)


# Rows of the merged dashboard's tables at most: what one worker's page shows
# (gateway/edge/admin/state.py MAX_DECISIONS).
MAX_ROWS = 500


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def merge_metrics(texts: Sequence[str], configured: int) -> bytes:
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(
                family.name, Metric(family.name, family.documentation, family.type)
            )
            series = values.setdefault(family.name, {})
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                old = series.get(key)
                if old is None:
                    series[key] = sample.value
                elif sample.name.endswith("_created"):
                    series[key] = min(old, sample.value)
                elif family.name in SAME_EVERYWHERE:
                    series[key] = max(old, sample.value)
                else:
                    series[key] = old + sample.value
            del merged  # filled below, once every worker's samples are in
    out = []
    for name, family in families.items():
        for (sample_name, labels), value in values[name].items():
            family.add_sample(sample_name, dict(labels), value)
        out.append(family)
    workers = Metric("shapegate_workers", "Worker processes of this gateway.", "gauge")
    workers.add_sample("shapegate_workers", {"state": "configured"}, configured)
    workers.add_sample("shapegate_workers", {"state": "answered"}, len(texts))
    out.append(workers)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(out))
    return generate_latest(registry)


def _sum(states: Sequence[dict[str, Any]], key: str) -> Any:
    return sum(s.get(key) or 0 for s in states)


def _max(values: Sequence[Any]) -> Any:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _sum_counts(dicts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for d in dicts:
        for key, value in d.items():
            out[key] = out.get(key, 0) + value
    return out


def _workers(states: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(
        (
            {
                **s.get("worker", {}),
                "in_flight": s.get("in_flight"),
                # Of those in flight, the ones waiting in this worker's queues for a slot.
                "queued": sum(lane.get("queue_depth") or 0 for lane in s.get("lanes", [])),
                "accepting": s.get("accepting"),
                "policy_version": s.get("policy_version"),
            }
            for s in states
        ),
        key=lambda w: w.get("index", 0),
    )


def _endpoints(states: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Clusters as the first state has them, each endpoint's in-flight summed."""
    in_flight: dict[tuple[str, str], int] = {}
    for state in states:
        for cluster in state["clusters"]:
            for endpoint in cluster["endpoints"]:
                key = (cluster["name"], endpoint["url"])
                in_flight[key] = in_flight.get(key, 0) + (endpoint.get("in_flight") or 0)
    return [
        {
            **cluster,
            "endpoints": [
                {**e, "in_flight": in_flight[(cluster["name"], e["url"])]}
                for e in cluster["endpoints"]
            ],
        }
        for cluster in states[0]["clusters"]
    ]


def _lanes(states: Sequence[dict[str, Any]], merge_one: Any) -> list[dict[str, Any]]:
    by_name = [{lane["name"]: lane for lane in s["lanes"]} for s in states]
    return [
        merge_one(lane, [b[lane["name"]] for b in by_name if lane["name"] in b])
        for lane in states[0]["lanes"]
    ]


def _queue_fields(lane: dict[str, Any], all_: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        **lane,
        "queue_depth": _sum(all_, "queue_depth"),
        "oldest_wait_s": _max([x.get("oldest_wait_s") for x in all_]),
    }


def _tagged(states: Sequence[dict[str, Any]], key: str) -> list[list[dict[str, Any]]]:
    """Each state's rows under ``key``, each row tagged with its worker's index."""
    return [[{**row, "worker": s.get("worker", {}).get("index")} for row in s[key]] for s in states]


def _interleave(lists: Sequence[list[dict[str, Any]]], key: str | None, limit: int) -> list[Any]:
    """Newest first by ``key``; without one (the admin state's decisions carry no wall time),
    worker by worker."""
    rows = [row for rows in lists for row in rows]
    if key is not None:
        rows.sort(key=lambda r: r.get(key) or 0, reverse=True)
    return rows[:limit]


def _prefix_index(states: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Every worker's prefix index summed (each worker holds its own), ages and lags at their
    highest; None when no worker reports one."""
    parts = [s["prefix_index"] for s in states if s.get("prefix_index")]
    if not parts:
        return None
    endpoints: dict[str, dict[str, Any]] = {}
    for part in parts:
        for url, row in part.get("endpoints", {}).items():
            merged = endpoints.get(url)
            if merged is None:
                endpoints[url] = dict(row)
                continue
            merged["blocks"] = (merged.get("blocks") or 0) + (row.get("blocks") or 0)
            for key in ("capacity_blocks", "lag_s"):
                if key in row or key in merged:
                    merged[key] = _max([merged.get(key), row.get(key)])
            if "rebuilds" in row or "rebuilds" in merged:
                merged["rebuilds"] = (merged.get("rebuilds") or 0) + (row.get("rebuilds") or 0)
    return {
        **parts[0],
        **{
            key: _sum(parts, key)
            for key in ("entries", "bound", "evicted", "expired", "overflowed")
        },
        "oldest_age_s": _max([p.get("oldest_age_s") for p in parts]),
        "lag_s": _max([p.get("lag_s") for p in parts]),
        "endpoints": endpoints,
    }


def merge_admin_state(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    first = states[0]
    prefix_index = _prefix_index(states)
    return {
        **first,
        "in_flight": _sum(states, "in_flight"),
        "accepting": all(s["accepting"] for s in states),
        "lanes": _lanes(states, _queue_fields),
        "clusters": _endpoints(states),
        # Each worker's ring (server.decision_ring_size), worker by worker.
        "decisions": _interleave(_tagged(states, "decisions"), None, MAX_ROWS * len(states)),
        "workers": _workers(states),
        **({"prefix_index": prefix_index} if prefix_index is not None else {}),
    }


def _percentiles(all_: list[dict[str, Any]], key: str) -> dict[str, Any]:
    parts = [x[key] for x in all_ if x.get(key)]
    return {
        "p50": _max([p.get("p50") for p in parts]),
        "p95": _max([p.get("p95") for p in parts]),
        "p99": _max([p.get("p99") for p in parts]),
        "n": sum(p.get("n") or 0 for p in parts),
    }


# Series of the rolling window: summed (rates, queue) or the highest (latencies, the slots the
# shared store counted, which every worker sampled).
SUMMED_SERIES = frozenset({"rate", "failed", "queue"})


def _series(all_: list[dict[str, Any]]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for name, first in all_[0].get("series", {}).items():
        columns = [x["series"].get(name, []) for x in all_]
        merged = []
        for i in range(len(first)):
            points = [c[i] for c in columns if i < len(c)]
            if name in SUMMED_SERIES:
                known = [p for p in points if p is not None]
                merged.append(round(sum(known), 3) if known else None)
            else:
                merged.append(_max(points))
        out[name] = merged
    return out


def _dashboard_lane(lane: dict[str, Any], all_: list[dict[str, Any]]) -> dict[str, Any]:
    clusters = {c["name"]: dict(c) for c in lane["clusters"]}
    for name, cluster in clusters.items():
        here = [c.get("slots_in_use") for x in all_ for c in x["clusters"] if c["name"] == name]
        known = [h for h in here if h is not None]
        cluster["slots_in_use"] = sum(known) if known else None
    return {
        **_queue_fields(lane, all_),
        "clusters": list(clusters.values()),
        "rate_rps": round(_sum(all_, "rate_rps"), 3),
        "outcomes": _sum_counts([x.get("outcomes", {}) for x in all_]),
        "ttft": _percentiles(all_, "ttft"),
        "e2e": _percentiles(all_, "e2e"),
        "series": _series(all_),
    }


def merge_dashboard(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    first = states[0]
    totals = {name: _sum_counts([s["totals"][name] for s in states]) for name in first["totals"]}
    return {
        **first,
        "in_flight": _sum(states, "in_flight"),
        "accepting": all(s["accepting"] for s in states),
        "state_degraded": any(s["state_degraded"] for s in states),
        "lanes": _lanes(states, _dashboard_lane),
        "unrouted": _sum_counts([s["unrouted"] for s in states]),
        "clusters": _endpoints(states),
        "decisions": _interleave(_tagged(states, "decisions"), "at", MAX_ROWS),
        "events": _interleave(_tagged(states, "events"), "at", MAX_ROWS),
        "totals": totals,
        "workers": _workers(states),
    }
