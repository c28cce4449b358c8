"""The gateway-wide view merged from each worker's (gateway/edge/admin/merge.py)."""

from __future__ import annotations

from typing import Any

from gateway.edge.admin.merge import merge_admin_state, merge_dashboard, merge_metrics
from gateway.observe.metrics import Metrics
from tests.support.prom import parse


def worker_metrics(requests: int, held: int, limit: int, up: int) -> str:
    metrics = Metrics([30.0])
    metrics.requests.labels(lane="fast", cluster="c", outcome="ok", status_class="2xx").inc(
        requests
    )
    metrics.slots_in_use.labels(lane="fast", cluster="c").set(held)
    metrics.slots_limit.labels(lane="fast", cluster="c").set(limit)
    metrics.engine_up.labels(cluster="c", endpoint="http://e").set(up)
    metrics.e2e.labels(lane="fast", cluster="c", endpoint="http://e").observe(0.2)
    return metrics.render().decode()


def test_counters_histograms_and_held_slots_add_up_limits_do_not() -> None:
    merged = parse(
        merge_metrics([worker_metrics(5, 2, 8, 1), worker_metrics(7, 1, 8, 0)], 2).decode()
    )
    assert merged.value("shapegate_requests_total", lane="fast") == 12
    assert merged.value("shapegate_slots_in_use", lane="fast") == 3
    assert merged.value("shapegate_slots_limit", lane="fast") == 8  # not 16
    assert merged.value("shapegate_engine_up", cluster="c") == 1  # up where any worker saw it
    assert merged.value("shapegate_e2e_seconds_count", lane="fast") == 2
    assert merged.value("shapegate_e2e_seconds_bucket", lane="fast", le="0.25") == 2
    assert merged.value("shapegate_workers", state="configured") == 2
    assert merged.value("shapegate_workers", state="answered") == 2
    assert merged.value("shapegate_build_info") == 1


def test_a_worker_that_did_not_answer_is_counted_as_missing() -> None:
    merged = parse(merge_metrics([worker_metrics(5, 0, 8, 1)], 3).decode())
    assert merged.value("shapegate_workers", state="answered") == 1
    assert merged.value("shapegate_workers", state="configured") == 3


def admin(index: int, in_flight: int, queue: int, wait: float, ep_in_flight: int) -> dict[str, Any]:
    return {
        "policy_version": 1,
        "accepting": True,
        "in_flight": in_flight,
        "lanes": [{"name": "fast", "slots_in_use": 4, "queue_depth": queue, "oldest_wait_s": wait}],
        "clusters": [{"name": "c", "endpoints": [{"url": "http://e", "in_flight": ep_in_flight}]}],
        "decisions": [{"request_id": f"r{index}"}],
        "worker": {"index": index, "pid": 100 + index},
    }


def test_admin_state_sums_what_each_worker_holds_and_keeps_the_shared_count() -> None:
    merged = merge_admin_state([admin(1, 3, 2, 0.5, 3), admin(0, 1, 1, 1.5, 1)])
    lane = merged["lanes"][0]
    assert lane["slots_in_use"] == 4  # the shared store's count, already gateway-wide
    assert lane["queue_depth"] == 3 and lane["oldest_wait_s"] == 1.5
    assert merged["in_flight"] == 4
    assert merged["clusters"][0]["endpoints"][0]["in_flight"] == 4
    assert [w["index"] for w in merged["workers"]] == [0, 1]
    assert [w["pid"] for w in merged["workers"]] == [100, 101]
    assert [(w["in_flight"], w["queued"]) for w in merged["workers"]] == [(1, 1), (3, 2)]
    assert {(d["request_id"], d["worker"]) for d in merged["decisions"]} == {("r1", 1), ("r0", 0)}


def dashboard(index: int, rate: float, p95: float, at: float) -> dict[str, Any]:
    lane = admin(index, 1, 1, 0.1, 1)["lanes"][0]
    lane.update(
        clusters=[{"name": "c", "slots_in_use": 1.0}],
        rate_rps=rate,
        outcomes={"ok": 10},
        ttft={"p50": p95 / 2, "p95": p95, "p99": p95, "n": 10},
        e2e={"p50": None, "p95": None, "p99": None, "n": 0},
        series={"rate": [rate, None], "ttft_p95": [p95, None], "slots": [4.0, 4.0]},
    )
    return {
        **admin(index, 1, 1, 0.1, 1),
        "lanes": [lane],
        "state_degraded": False,
        "unrouted": {"refused": 1},
        "decisions": [{"request_id": f"r{index}", "at": at}],
        "events": [],
        "totals": {"swallowed": {"x": 1.0}, "watchdog": {}},
    }


def test_dashboard_rates_add_up_percentiles_take_the_highest() -> None:
    merged = merge_dashboard([dashboard(0, 2.0, 0.4, 10.0), dashboard(1, 3.0, 0.9, 20.0)])
    lane = merged["lanes"][0]
    assert lane["rate_rps"] == 5.0 and lane["outcomes"] == {"ok": 20}
    assert lane["ttft"] == {"p50": 0.45, "p95": 0.9, "p99": 0.9, "n": 20}
    assert lane["e2e"]["p95"] is None
    assert lane["series"] == {"rate": [5.0, None], "ttft_p95": [0.9, None], "slots": [4.0, 4.0]}
    assert lane["clusters"] == [{"name": "c", "slots_in_use": 2.0}]
    assert merged["unrouted"] == {"refused": 2}
    assert merged["totals"]["swallowed"] == {"x": 2.0}
    assert [d["request_id"] for d in merged["decisions"]] == ["r1", "r0"]  # newest first


def prefix_index(entries: int, a: int, lag: float | None, oldest: float) -> dict[str, Any]:
    endpoints: dict[str, Any] = {
        "http://a": {"source": "approximate", "blocks": a, "capacity_blocks": 64},
    }
    if lag is not None:
        endpoints["http://k"] = {"source": "kv_events", "blocks": 7, "lag_s": lag, "rebuilds": 1}
    return {
        "source": "kv_events",
        "block_tokens": 128,
        "entries": entries,
        "bound": 1000,
        "oldest_age_s": oldest,
        "evicted": 3,
        "expired": 1,
        "overflowed": 2,
        "lag_s": lag,
        "endpoints": endpoints,
    }


def test_admin_state_sums_each_workers_prefix_index() -> None:
    """Each worker holds its own index: the gateway's holds them all (entries, bounds, blocks
    per endpoint summed), its oldest entry and worst KV-events lag are the highest."""
    one = {**admin(0, 0, 0, 0.0, 0), "prefix_index": prefix_index(40, 40, 0.2, 5.0)}
    two = {**admin(1, 0, 0, 0.0, 0), "prefix_index": prefix_index(25, 25, 0.5, 9.0)}
    merged = merge_admin_state([one, two])["prefix_index"]
    assert (merged["entries"], merged["bound"]) == (65, 2000)
    assert (merged["evicted"], merged["expired"], merged["overflowed"]) == (6, 2, 4)
    assert merged["oldest_age_s"] == 9.0 and merged["lag_s"] == 0.5
    assert merged["endpoints"]["http://a"] == {
        "source": "approximate",
        "blocks": 65,
        "capacity_blocks": 64,
    }
    assert merged["endpoints"]["http://k"] == {
        "source": "kv_events",
        "blocks": 14,
        "lag_s": 0.5,
        "rebuilds": 2,
    }
    assert merged["source"] == "kv_events" and merged["block_tokens"] == 128
    # A worker's endpoint the first never recorded is kept; no lag anywhere stays null.
    three = {**admin(2, 0, 0, 0.0, 0), "prefix_index": prefix_index(3, 3, None, 1.0)}
    three["prefix_index"]["endpoints"]["http://b"] = {"source": "approximate", "blocks": 3}
    alone = merge_admin_state([three, three])["prefix_index"]
    assert alone["lag_s"] is None and alone["endpoints"]["http://b"]["blocks"] == 6
    # States from a build without one merge as before.
    assert "prefix_index" not in merge_admin_state([admin(0, 0, 0, 0.0, 0)])
