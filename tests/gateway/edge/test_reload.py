"""Hot reload: validated in full, swapped whole, in-flight requests finish under their policy."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml
from structlog.testing import capture_logs

from gateway.config_check import load_settings
from gateway.count.tokenizers.processes import _running
from gateway.count.tokens import TokenCounter
from gateway.edge.app import create_app
from gateway.edge.reload import diff_settings
from gateway.settings import parse_settings
from tests.conftest import ADMIN, JSON, lanes_config
from tests.support.fake_engine import FakeEngine
from tests.support.servers import free_port, serve_asgi, start_gateway, until_ok
from tests.support.waiting import wait_for


def body(delay: float = 0.0, content: str = "hi") -> bytes:
    fake = {"mode": "slow_first_byte", "delay": delay} if delay else {}
    return orjson.dumps(
        {"model": "qwen3.6", "fake": fake, "messages": [{"role": "user", "content": content}]}
    )


def test_the_diff_names_what_changed() -> None:
    old = parse_settings(lanes_config(["http://a"], ["http://b"]), environ={})
    config = lanes_config(["http://a", "http://c"], ["http://b"])
    config["lanes"][0]["slots"]["lane"] = 40
    new = parse_settings(config, environ={})
    diff = diff_settings(old, new)
    assert diff["lanes[fast].slots.lane"] == {"old": 64, "new": 40}
    assert diff["clusters[fast].endpoints"]["new"] == ["http://a", "http://c"]
    assert len(diff) == 2


async def test_reload_under_load_loses_nothing_and_a_lowered_limit_holds(
    gateway_at: Any,
) -> None:
    engine = FakeEngine()
    async with serve_asgi(engine) as engine_url:
        config = lanes_config([engine_url], [engine_url])
        config["lanes"][0]["slots"] = {"lane": 8, "per_endpoint": 8}
        async with gateway_at(config) as (url, _), httpx.AsyncClient(timeout=30) as client:

            def send(rid: str, delay: float) -> asyncio.Task[httpx.Response]:
                return asyncio.create_task(
                    client.post(
                        url + "/v1/chat/completions",
                        content=body(delay),
                        headers={"x-request-id": rid, **JSON},
                    )
                )

            first = [send(f"first-{i}", 0.5) for i in range(8)]
            await wait_for(lambda: engine.in_flight == 8, 5, what="8 requests in flight")
            lowered = lanes_config([engine_url], [engine_url])
            lowered["lanes"][0]["slots"] = {"lane": 2, "per_endpoint": 2}
            with capture_logs() as logs:
                r = await client.post(
                    url + "/admin/reload", content=yaml.safe_dump(lowered), headers=ADMIN
                )
            assert r.status_code == 200, r.text
            assert r.json()["changed"]["lanes[fast].slots.lane"] == {"old": 8, "new": 2}
            reloaded = next(e for e in logs if e["event"] == "policy.reloaded")
            assert reloaded["version"] == 2
            later = [send(f"later-{i}", 0.05) for i in range(12)]
            replies = await asyncio.gather(*first, *later)
            assert [r.status_code for r in replies] == [200] * 20
            state = (await client.get(url + "/admin/state")).json()
            assert state["policy_version"] == 2
            assert all(lane["slots_in_use"] == 0 for lane in state["lanes"])
    # Whenever a request admitted under the lowered limit started, at most 2 were in flight,
    # old ones included: nothing new got in while the 8 old ones held the lane.
    assert max(_in_flight_at_arrivals(engine, "later-")) <= 2


def _in_flight_at_arrivals(engine: FakeEngine, prefix: str) -> list[int]:
    spans = [(s.arrived, s.closed or time.monotonic()) for s in engine.seen.values()]
    return [
        sum(1 for a, c in spans if a <= seen.arrived < c)
        for rid, seen in engine.seen.items()
        if rid.startswith(prefix)
    ]


async def test_an_invalid_policy_changes_nothing(gateway_at: Any) -> None:
    engine = FakeEngine()
    async with serve_asgi(engine) as engine_url:
        config = lanes_config([engine_url], [engine_url])
        async with gateway_at(config) as (url, _), httpx.AsyncClient() as client:
            bad = lanes_config([engine_url], [engine_url])
            bad["lanes"][0]["clusters"] = ["nowhere"]
            with capture_logs() as logs:
                r = await client.post(
                    url + "/admin/reload", content=yaml.safe_dump(bad), headers=ADMIN
                )
            assert r.status_code == 400 and "nowhere" in r.json()["error"]["message"]
            assert any(e["event"] == "policy.reload_failed" for e in logs)
            typo = await client.post(url + "/admin/reload", content=b"lanes: [}", headers=ADMIN)
            assert typo.status_code == 400
            state = (await client.get(url + "/admin/state")).json()
            assert state["policy_version"] == 1
            ok = await client.post(url + "/v1/chat/completions", content=body(), headers=JSON)
            assert ok.status_code == 200


async def test_added_and_removed_clusters(gateway_at: Any) -> None:
    old, new = FakeEngine(), FakeEngine()
    async with serve_asgi(old) as old_url, serve_asgi(new) as new_url:
        config = lanes_config([old_url], [old_url])
        async with gateway_at(config) as (url, _), httpx.AsyncClient(timeout=10) as client:
            running = asyncio.create_task(
                client.post(url + "/v1/chat/completions", content=body(0.5), headers=JSON)
            )
            await wait_for(lambda: old.in_flight == 1, 5, what="request on the old endpoint")
            moved = lanes_config([new_url], [new_url])
            r = await client.post(
                url + "/admin/reload", content=yaml.safe_dump(moved), headers=ADMIN
            )
            assert r.status_code == 200
            after = await client.post(url + "/v1/chat/completions", content=body(), headers=JSON)
            assert after.status_code == 200
            assert (await running).status_code == 200  # finished on the removed endpoint
            assert len(old.seen) == 1 and len(new.seen) == 1
            state = (await client.get(url + "/admin/state")).json()
            urls = [e["url"] for c in state["clusters"] for e in c["endpoints"]]
            assert urls == [new_url, new_url]


async def test_sighup_reloads_a_served_gateway(tmp_path: Path) -> None:
    engine = FakeEngine()
    async with serve_asgi(engine) as engine_url:
        config = lanes_config([engine_url], [engine_url])
        config["server"].update(watch_config=False)  # only the signal can reload it
        path = tmp_path / "policy.yaml"
        path.write_text(yaml.safe_dump(config))
        port = free_port()
        proc = start_gateway(path, port)
        url = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient() as client:
                await until_ok(client, url + "/healthz")
                config["lanes"][0]["slots"] = {"lane": 6, "per_endpoint": 6}
                path.write_text(yaml.safe_dump(config))
                proc.send_signal(signal.SIGHUP)
                await _until_version(client, url, 2)
                state = (await client.get(url + "/admin/state")).json()
                assert state["lanes"][0]["slot_limit"] == 6
                # SIGHUP refuses what check-config refuses: a gap between the lanes. Signals
                # are handled in order, so once the next (valid) one lands as version 3, the
                # gap was refused, not applied.
                config["lanes"][1]["min_prompt_tokens"] += 1000
                path.write_text(yaml.safe_dump(config))
                proc.send_signal(signal.SIGHUP)
                await asyncio.sleep(0.2)  # two signals at once may be delivered as one
                config["lanes"][1]["min_prompt_tokens"] -= 1000
                config["lanes"][0]["slots"] = {"lane": 7, "per_endpoint": 7}
                path.write_text(yaml.safe_dump(config))
                proc.send_signal(signal.SIGHUP)
                await _until_version(client, url, 3)
                state = (await client.get(url + "/admin/state")).json()
                assert state["lanes"][0]["slot_limit"] == 7 and state["policy_version"] == 3
        finally:
            proc.send_signal(signal.SIGTERM)
            out, _ = await asyncio.to_thread(proc.communicate, timeout=20)
        assert proc.returncode == 0
        assert b'"policy.reloaded"' in out
        failed = [line for line in out.splitlines() if b'"policy.reload_failed"' in line]
        assert b'"trigger": "sighup"' in b"".join(failed).replace(b'":"', b'": "')
        for line in failed:
            assert b"lanes.1.min_prompt_tokens: gap" in line and f"{path}:".encode() in line


async def test_the_file_watcher_reloads_a_changed_policy(
    tmp_path: Path, counter: TokenCounter
) -> None:
    engine = FakeEngine()
    async with serve_asgi(engine) as engine_url:
        config = lanes_config([engine_url], [engine_url])
        config["server"].update(watch_config=True, watch_interval_s=0.1)
        path = tmp_path / "policy.yaml"
        path.write_text(yaml.safe_dump(config))
        app = create_app(load_settings(path), counter, config_path=path)
        async with serve_asgi(app) as url, httpx.AsyncClient() as client:
            config["lanes"][0]["slots"] = {"lane": 5, "per_endpoint": 5}
            path.write_text(yaml.safe_dump(config))
            await _until_version(client, url, 2)  # no signal was sent: the watcher saw it
            state = (await client.get(url + "/admin/state")).json()
            assert state["lanes"][0]["slot_limit"] == 5


async def _until_version(client: httpx.AsyncClient, url: str, version: int) -> None:
    async def arrived() -> bool:
        state = (await client.get(url + "/admin/state")).json()
        return bool(state["policy_version"] >= version)

    await wait_for(arrived, 10, interval=0.05, what=f"policy version {version}")


def _child_pid(app: Any) -> int:
    encoder = app.gateway.counter._model("qwen3.6").vocab.encoder
    pid: int = encoder.pid
    return pid


def _alive(pid: int) -> bool:
    """Running: a zombie is gone. A counting child is the template's; killed after the
    template's last reap, it is reparented to pid 1, and a pid 1 that reaps late (or never, as
    this machine's) leaves its ``/proc`` entry behind, which CI saw twice."""
    return _running(pid)


async def test_a_replaced_counter_is_closed_after_its_last_request_and_at_shutdown() -> None:
    """The gateway's own counter (gigatoken in a child process): a reload that changes the
    models loads a new one; the old one's child lives while a request admitted under it runs
    and is stopped once that request finished; shutdown stops the new one's."""
    engine = FakeEngine()
    async with serve_asgi(engine) as engine_url:
        config = lanes_config([engine_url], [engine_url])
        app = create_app(parse_settings(config, environ={}))  # loads its own counter
        old_pid = _child_pid(app)
        async with serve_asgi(app) as url, httpx.AsyncClient(timeout=30) as client:
            running = asyncio.create_task(
                client.post(
                    url + "/v1/chat/completions",
                    content=body(delay=1.5, content="x " * 3000),  # counted in the worker
                    headers={"x-request-id": "old", **JSON},
                )
            )
            await wait_for(lambda: "old" in engine.seen, 10, what="the request at the engine")
            changed = lanes_config([engine_url], [engine_url])
            changed["models"][0] = {**changed["models"][0], "max_model_len": 500_000}
            r = await client.post(
                url + "/admin/reload", content=yaml.safe_dump(changed), headers=ADMIN
            )
            assert r.status_code == 200, r.text
            new_pid = _child_pid(app)
            assert new_pid != old_pid
            assert _alive(old_pid)  # the request admitted under it still runs
            answer = await running
            assert answer.status_code == 200
            assert int(answer.headers["x-shapegate-prompt-tokens"]) > 3000
            await wait_for(lambda: not _alive(old_pid), 10, what="the old tokenizer child gone")
            assert _alive(new_pid)
        # serve_asgi's exit ran the lifespan's shutdown (which waits for the kill).
        assert not _alive(new_pid)


async def test_a_reload_turns_tracing_on_and_off_for_new_requests(counter: TokenCounter) -> None:
    """Tracing is hot-reloadable: on, the engine gets a traceparent; off again, the exporter is
    retired (flushed and shut down after its last span) and no header is added."""
    engine = FakeEngine()
    async with serve_asgi(engine) as engine_url:
        config = lanes_config([engine_url], [engine_url])
        app = create_app(parse_settings(config, environ={}), counter)
        async with serve_asgi(app) as url, httpx.AsyncClient(timeout=30) as client:

            async def reload_and_send(tracing: dict[str, Any], rid: str) -> None:
                policy = {**config, "tracing": tracing}
                r = await client.post(
                    url + "/admin/reload", content=yaml.safe_dump(policy), headers=ADMIN
                )
                assert r.status_code == 200, r.text
                answer = await client.post(
                    url + "/v1/chat/completions",
                    content=body(),
                    headers={"x-request-id": rid, **JSON},
                )
                assert answer.status_code == 200

            closed_port = free_port()
            endpoint = f"http://127.0.0.1:{closed_port}/v1/traces"
            await reload_and_send({"enabled": True, "endpoint": endpoint}, "on")
            tracing = app.gateway.recorder.tracing
            assert tracing is not None and "traceparent" in engine.seen["on"].headers
            await reload_and_send({"enabled": False, "endpoint": endpoint}, "off")
            assert app.gateway.recorder.tracing is None and tracing.in_use.retired
            assert "traceparent" not in engine.seen["off"].headers


def test_the_prefix_index_settings_need_a_restart_and_lane_weights_do_not() -> None:
    from gateway.edge.reload import _restart_only

    old = parse_settings(lanes_config(["http://a"], ["http://b"]), environ={})
    config = lanes_config(["http://a"], ["http://b"])
    config["prefix_index"] = {"max_blocks": 10}
    config["lanes"][0]["weights"] = {"prefix": 1.0}
    diff = diff_settings(old, parse_settings(config, environ={}))
    assert set(diff) == {"prefix_index.max_blocks", "lanes[fast].weights.prefix"}
    assert _restart_only("prefix_index.max_blocks")
    assert not _restart_only("lanes[fast].weights.prefix")
    # The KV event readers are the prefix index's, started with it.
    config["prefix_index"] = {"source": "kv_events"}
    config["clusters"][0]["kv_events"] = {"port": 5557}
    diff = diff_settings(old, parse_settings(config, environ={}))
    assert "clusters[fast].kv_events.port" in diff
    assert _restart_only("clusters[fast].kv_events.port")
    assert not _restart_only("clusters[fast].endpoints")
