"""``shapegate bench monsters --smoke``: unique monster prompts through a real gateway, the first
burst after boot against the steady state, each phase's tail, CPU and recycles."""

from __future__ import annotations

import json
import os
from pathlib import Path

from gateway.tools.bench.texts import CHARS_PER_TOKEN, SHAPES, Texts
from gateway.tools.cli import main


def test_bench_monsters_smoke_reports_every_phase_and_its_verdicts(tmp_path: Path) -> None:
    assert main(["bench", "monsters", "--smoke", "--out", str(tmp_path)]) == 0

    result = json.loads((tmp_path / "monsters.json").read_text())
    assert (tmp_path / "monsters.png").stat().st_size > 10_000
    assert result["smoke"] is True and result["machine"]["load_average"]
    first = result["first_burst"]
    assert first["statuses"] == [200] * result["slots"]
    # Exact counts of unique texts near the asked size (the figure is the gateway's header).
    assert all(30_000 < t < 50_000 for t in first["tokens"]), first["tokens"]
    assert first["steady_requests"] == 2 * result["slots"]
    slowest = max(first["latencies_ms"])
    assert abs(first["worst_ratio"] - slowest / first["steady_median_ms"]) < 0.02
    assert [p["shape"] for p in result["phases"]] == ["prose", "letters"]
    for phase in result["phases"]:
        assert phase["requests"] == 4 and phase["errors"] == 0, phase
        assert 0 < phase["p50_ms"] <= phase["p99_ms"]
        # The gateway and its child are read in clock ticks (10 ms): 4 small requests may be 0.
        assert phase["cpu_ms_per_request"] >= 0
        assert phase["recycles"] == len(phase["recycle_load_s"])
    # Each target's verdict matches its value and limit (every smoke target is "at most").
    assert len(result["targets"]) == 1 + len(result["phases"]) + 1
    for target in result["targets"]:
        assert target["met"] == (target["value"] <= target["limit"]), target


def test_cpu_counts_a_process_its_live_children_and_its_reaped_ones() -> None:
    import subprocess
    import sys

    from gateway.tools.bench.monsters import _cpu_s

    before = _cpu_s(os.getpid())
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    subprocess.run([sys.executable, "-c", burn], check=True)  # reaped: in our children's time
    assert _cpu_s(os.getpid()) - before >= 0.25
    # A grandchild reaped by a child that still runs (a counting child the tokenizer template
    # forked and reaped): in that child's children's time, which is read while it lives.
    parent = (
        "import os, sys, time\n"
        f"pid = os.fork()\nif pid == 0:\n    {burn.replace(chr(10), chr(10) + '    ')}\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\nprint('reaped', flush=True)\ntime.sleep(30)\n"
    )
    start = _cpu_s(os.getpid())
    middle = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE)
    try:
        assert middle.stdout is not None and middle.stdout.readline() == b"reaped\n"
        assert _cpu_s(os.getpid()) - start >= 0.25
    finally:
        middle.kill()
        middle.wait()
        if middle.stdout is not None:
            middle.stdout.close()


def test_every_text_is_new_and_near_its_size() -> None:
    texts = Texts.load()
    seen = set()
    for shape in SHAPES:
        for _ in range(2):
            text = texts.unique(shape, 2_000)
            assert text not in seen
            seen.add(text)
            assert abs(len(text) - 2_000 * CHARS_PER_TOKEN[shape]) <= 1, shape
