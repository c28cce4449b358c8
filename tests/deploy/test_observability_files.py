"""The Grafana dashboard and the Prometheus rules query metrics a real gateway exports.

Every ``shapegate_*`` series they name, and every label they match on, must appear in the
``/metrics`` of a gateway that served traffic (simulated engines, a dead spare endpoint, a
deadline hit): a renamed metric or label fails here, not silently on a wall screen.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from engine_pool.sim.server import run_sim
from gateway.count.tokens import TokenCounter
from gateway.edge.app import create_app
from gateway.settings import parse_settings
from gateway.tools.sim_support import RegistryCounter
from tests.conftest import ROOT, lanes_config
from tests.support.prom import Scrape, parse
from tests.support.servers import free_port, serve_asgi

GRAFANA = ROOT / "deploy" / "grafana" / "shapegate.json"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
NAME = re.compile(r"\bshapegate_[a-z_]+\b")
SELECTOR = re.compile(r"\b(shapegate_[a-z_]+)\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)")
# Grafana variables stand for label values inside these queries, never for label names.
VARIABLE = re.compile(r"\$\w+|\$\{\w+\}")


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def walk(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from walk(value)


def dashboard_queries() -> list[str]:
    dashboard = json.loads(GRAFANA.read_text(encoding="utf-8"))
    queries = [n["expr"] for n in walk(dashboard["panels"]) if "expr" in n]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return queries


def rule_queries() -> list[str]:
    return [rule["expr"] for group in load_yaml(ALERTS)["groups"] for rule in group["rules"]]


@pytest.fixture(scope="module")
def served(counter: TokenCounter) -> Scrape:
    """The /metrics of a gateway after traffic; built once, shared by this module's checks."""
    return asyncio.run(_serve_traffic(counter))


async def _serve_traffic(counter: TokenCounter) -> Scrape:
    shared = RegistryCounter(counter, "qwen3.6")
    dead = f"http://127.0.0.1:{free_port()}"
    async with contextlib.AsyncExitStack() as stack:
        fast = await stack.enter_async_context(
            run_sim("h100-fast", time_scale=0.05, counter=shared)
        )
        heavy = await stack.enter_async_context(
            run_sim("h100-heavy", time_scale=0.05, counter=shared)
        )
        config = lanes_config([fast.url], [heavy.url])
        config["clusters"].append({"name": "spare", "endpoints": [dead]})
        health = {"interval_s": 0.1, "timeout_s": 1, "scrape_interval_s": 0.1}
        for lane in config["lanes"]:
            lane["health"] = health
        config["lanes"][1]["emergency_clusters"] = ["spare"]
        # A stall longer than the fast lane's idle deadline: a watchdog event.
        config["lanes"][0]["timeouts"] = {"first_byte_s": 5, "idle_s": 0.3, "total_s": 20}
        settings = parse_settings(config, environ={})
        url = await stack.enter_async_context(serve_asgi(create_app(settings, counter)))
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=30))
        for text in ("hi", "word " * 5000):
            body = {
                "model": "qwen3.6",
                "messages": [{"role": "user", "content": text}],
                "max_tokens": 8,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        await fast.set_faults({"stall_after_tokens": 2})
        stalled = {"model": "qwen3.6", "messages": [{"role": "user", "content": "x"}]}
        await client.post("/v1/chat/completions", json={**stalled, "stream": True})
        for _ in range(100):
            scrape = parse((await client.get("/metrics")).text)
            if scrape.has("shapegate_swallowed_errors_total") and scrape.has(
                "shapegate_engine_load", what="running"
            ):
                return scrape
            await asyncio.sleep(0.05)
        return scrape


def test_files_parse_and_are_shaped_for_their_tools() -> None:
    dashboard = json.loads(GRAFANA.read_text(encoding="utf-8"))
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"] and dashboard["schemaVersion"] >= 36
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}"
            assert panel["targets"] and all(t["expr"] for t in panel["targets"])
    config = load_yaml(PROMETHEUS)
    assert [(PROMETHEUS.parent / f).exists() for f in config["rule_files"]] == [True]
    gateway_job = next(j for j in config["scrape_configs"] if j["job_name"] == "shapegate")
    assert gateway_job["metrics_path"] == "/metrics"
    for group in load_yaml(ALERTS)["groups"]:
        for rule in group["rules"]:
            assert rule["labels"]["severity"] in {"warning", "critical"}
            assert rule["annotations"]["summary"]


def test_alerts_tell_a_slow_heavy_lane_from_a_down_engine_or_a_full_lane() -> None:
    rules = {
        rule["alert"]: rule for group in load_yaml(ALERTS)["groups"] for rule in group["rules"]
    }
    severity = {name: rule["labels"]["severity"] for name, rule in rules.items()}
    assert severity["ShapegateHeavyLaneSlow"] == "warning"
    assert severity["ShapegateEngineDown"] == "critical"
    assert severity["ShapegateLaneFull"] == "critical"
    assert severity["ShapegateEngineSlow"] == "warning"  # slow probes alert, never page
    slow = rules["ShapegateHeavyLaneSlow"]["expr"]
    assert 'shapegate_ttft_seconds_bucket{lane="heavy"}' in slow
    assert "shapegate_engine_up" in rules["ShapegateEngineDown"]["expr"]
    full = rules["ShapegateLaneFull"]["expr"]
    assert {"shapegate_slots_in_use", "shapegate_slots_limit", "shapegate_queue_depth"} <= set(
        NAME.findall(full)
    )
    assert "delta(shapegate_queue_depth" in full  # growing, not merely non-empty


@pytest.mark.parametrize("source", ["grafana", "alerts"])
def test_every_queried_metric_and_label_exists_in_metrics(source: str, served: Scrape) -> None:
    queries = dashboard_queries() if source == "grafana" else rule_queries()
    names = {name for q in queries for name in NAME.findall(q)}
    assert len(names) >= 8
    missing = sorted(names - served.names)
    assert missing == [], f"{source} queries metrics the gateway does not export: {missing}"
    for query in queries:
        for name, matchers in SELECTOR.findall(VARIABLE.sub("x", query)):
            labels = {k for n, have, _ in served.samples if n == name for k in have}
            for label in MATCHER.findall(matchers):
                assert label in labels, f"{name} has no label {label!r} (in {query!r})"


@pytest.mark.parametrize("source", ["grafana", "alerts"])
def test_quantiles_are_taken_over_buckets_by_le(source: str) -> None:
    queries = dashboard_queries() if source == "grafana" else rule_queries()
    quantile_queries = [q for q in queries if "histogram_quantile" in q]
    assert quantile_queries
    for query in quantile_queries:
        by = re.search(r"histogram_quantile\(\s*[\d.]+,\s*sum by \(([^)]*)\)", query)
        assert by is not None and "le" in [s.strip() for s in by.group(1).split(",")], query
        assert "_bucket" in query, query


def test_the_served_metrics_cover_every_family_the_issue_names(served: Scrape) -> None:
    # After real traffic these have samples, not just a declaration.
    for series in (
        "shapegate_requests_total",
        "shapegate_route_decisions_total",
        "shapegate_slots_in_use",
        "shapegate_slots_limit",
        "shapegate_queue_depth",
        "shapegate_queue_wait_seconds_bucket",
        "shapegate_prompt_tokens_bucket",
        "shapegate_output_tokens_bucket",
        "shapegate_ttft_seconds_bucket",
        "shapegate_itl_seconds_bucket",
        "shapegate_e2e_seconds_bucket",
        "shapegate_engine_up",
        "shapegate_engine_load",
        "shapegate_watchdog_events_total",
        "shapegate_state_degraded",
    ):
        assert served.has(series), series
    # The dead spare engine's failed checks are its own news, not swallowed (unexpected) errors.
    assert served.has("shapegate_engine_check_failures_total", cluster="spare")
    assert "shapegate_swallowed_errors_total" in served.names
    assert served.value("shapegate_engine_up", cluster="spare") == 0
    assert served.value("shapegate_engine_up", cluster="fast") == 1
    assert served.has("shapegate_watchdog_events_total", lane="fast", kind="idle")
    # The count-time family is declared (its samples live on the counter's own registry in
    # these tests, which share one loaded tokenizer).
    assert "shapegate_count_seconds_bucket" in served.names
