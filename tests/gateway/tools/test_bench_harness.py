"""gateway/tools/bench/harness.py: a process's memory with its descendants, the pages a fork
shares with its parent counted once (as the gateway's tokenizer template shares its loaded
tokenizer with each counting child)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from gateway.tools.bench.harness import Child, tree_rss_mb

# 96 MB written, then a fork that only reads it: both map the same pages until one writes.
SHARES = """
import os, sys, time
held = bytearray(os.urandom(96 * 2**20))
if os.fork() == 0:
    time.sleep(60)
    os._exit(0)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="Linux only")
def test_pss_counts_a_page_a_fork_shares_once(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    child = Child.start("shares", [sys.executable, "-c", SHARES], log, None)
    try:
        deadline = time.monotonic() + 30
        while b"ready" not in log.read_bytes():
            assert time.monotonic() < deadline and child.alive(), log.read_text()
            time.sleep(0.05)
        time.sleep(0.2)  # the fork is listed as the child's descendant
        pss, rss = child.pss_mb(), tree_rss_mb(child.pid)
        assert rss > 2 * 96  # resident memory counts the 96 MB in both processes
        assert 96 < pss < 96 + 60, (pss, rss)  # once, plus two interpreters' own
    finally:
        child.stop(grace_s=1)


# Spins about 25 ms of CPU in its main thread, then prints its own CPU time in nanoseconds.
SPINS = """
import sys, time
start = time.process_time_ns()
while time.process_time_ns() - start < 25_000_000:
    pass
print("spent", time.process_time_ns(), flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="Linux only")
def test_cpu_s_is_finer_than_a_clock_tick(tmp_path: Path) -> None:
    """A process's CPU seconds agree with its own clock to well under one 10 ms tick: what
    utime + stime alone cannot (bench shadow's CPU ratio measures ~30 us a request)."""
    log = tmp_path / "child.log"
    child = Child.start("spins", [sys.executable, "-c", SPINS], log, None)
    try:
        deadline = time.monotonic() + 30
        while b"spent" not in log.read_bytes():
            assert time.monotonic() < deadline and child.alive(), log.read_text()
            time.sleep(0.05)
        own = int(log.read_text().split()[1]) / 1e9  # the child's own process_time
        measured = child.cpu_s()
        # process_time was read just before the print; the print and the sleep's start cost
        # microseconds, not milliseconds.
        assert own <= measured < own + 0.002, (own, measured)
    finally:
        child.stop(2)
