"""The short soak: ``shapegate bench soak`` for 20 s (the 10-minute run is the same code).

A ``shapegate serve`` process in front of four time-scaled simulated engines, mixed lanes,
about 10% faults and 20% client resets; the invariant checked every 100 ms. Nothing may leak,
no engine may be left generating for a client that left, memory stays flat, SIGTERM exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import orjson

from engine_pool.sim.engine import SimEngine
from engine_pool.sim.profile import load_profile
from gateway.count.tokens import TokenCounter
from gateway.tools.bench import soak
from gateway.tools.bench.harness import write_json
from gateway.tools.bench.soak_traffic import SoakOptions
from gateway.tools.cli import build_parser
from gateway.tools.sim_support import RegistryCounter


async def test_a_short_soak_leaks_nothing(counter: TokenCounter, tmp_path: Path) -> None:
    options = SoakOptions(seconds=20, rate=30, seed=7)
    result = await soak.soak(options, counter=RegistryCounter(counter, "qwen3.6"))
    print(soak.table(result))

    assert result["leaked_slots"] == 0
    assert result["engine_orphans"] == 0
    assert result["engine_records_unclosed"] == 0
    assert result["invariant_violations"] == []
    assert result["invariant_checks"] >= 150  # every 100 ms, give or take a slow answer
    assert result["gateway_exit_code"] == 0
    assert result["memory_pss"]["growth_mb"] < soak.FLAT_MB
    assert result["passed"]

    # It was a soak worth the name: traffic in both lanes, resets, faults of several kinds.
    assert result["requests"] > 400
    assert 0.1 < result["disconnects"] / result["requests"] < 0.3
    assert len(result["faults_by_kind"]) >= 3 and result["fault_share"] > 0.04
    assert result["peak_slots_in_use"]["fast"] > 0 and result["peak_slots_in_use"]["heavy"] > 0
    outcomes = result["gateway_outcomes"]
    assert outcomes["ok"] > 0 and outcomes["client_disconnect"] > 0
    assert outcomes.get("upstream_error", 0) + outcomes.get("timeout", 0) > 0
    # Every client that stayed got an answer: a status, or a stream that ended properly.
    assert not [k for k in result["client_outcomes"] if k.startswith("transport:")]

    path = write_json(tmp_path, "soak", result)
    assert orjson.loads(path.read_bytes())["requests"] == result["requests"]


def test_the_soak_is_a_bench_suite() -> None:
    args = build_parser().parse_args(["bench", "soak", "--minutes", "10"])
    assert isinstance(args, argparse.Namespace) and args.func is soak.run
    assert args.minutes == 10 and args.out == "bench-results"


async def test_an_abort_racing_the_last_step_still_closes_the_engine_record() -> None:
    """The soak's "never closed" figure trusts the simulator's records: a client that leaves
    while the step producing its last token runs (the engine loop sleeps until the step's end)
    must not leave its record "running" for ever with nothing left in the engine."""
    engine = SimEngine(load_profile("h100-fast"), time_scale=10.0)
    await engine.start()
    try:
        stream = engine.submit("last", route="chat", prompt_tokens=100, output_tokens=1)
        # Its one step (prefill and its only token) takes ~0.28 s of wall time at this scale;
        # the scheduler already counts it finished, its delivery is still to come.
        await asyncio.sleep(0.1)
        assert engine.snapshot().running == 0 and stream.record.first_token_wall is None
        engine.abort(stream.key)
        await asyncio.sleep(0.4)  # past the step's end: its delivery finds the stream gone
        (record,) = engine.requests.find("last")
        assert record.outcome == "aborted" and record.closed_wall is not None
        snap = engine.snapshot()
        assert (snap.running, snap.waiting) == (0, 0)
    finally:
        await engine.stop()
