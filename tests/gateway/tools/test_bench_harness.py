"""gateway/tools/bench/harness.py: a process's memory with its descendants, the pages a fork
shares with its parent counted once (as the gateway's tokenizer template shares its loaded
tokenizer with each counting child)."""

from __future__ import annotations

import os
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


# Prints its own CPU time, waits for a file, spins 25 ms of CPU, prints its CPU time again.
SPINS = """
import os, sys, time
print("before", time.process_time_ns(), flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
start = time.process_time_ns()
while time.process_time_ns() - start < 25_000_000:
    pass
print("after", time.process_time_ns(), flush=True)
time.sleep(60)
"""


def _line(log: Path, word: str, child: Child) -> int:
    deadline = time.monotonic() + 30
    while True:
        for line in log.read_text().splitlines():
            if line.startswith(word + " "):
                return int(line.split()[1])
        assert time.monotonic() < deadline and child.alive(), log.read_text()
        time.sleep(0.01)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="Linux only")
def test_cpu_s_is_finer_than_a_clock_tick(tmp_path: Path) -> None:
    """The CPU a process spends between two readings agrees with its own clock to well under
    one 10 ms tick, what utime + stime cannot (a 25 ms spin reads 20 or 30 ms in ticks); bench
    shadow's CPU ratio measures ~30 us a request over rounds of 600 requests."""
    log, go = tmp_path / "child.log", tmp_path / "go"
    child = Child.start("spins", [sys.executable, "-c", SPINS, str(go)], log, None)
    try:
        own_before = _line(log, "before", child)
        time.sleep(0.1)  # the child polls for the file: asleep, its CPU time still
        before = child.cpu_s()
        go.touch()
        own_after = _line(log, "after", child)
        after = child.cpu_s()
        own, measured = (own_after - own_before) / 1e9, after - before
        # The child's own span runs from its first print to its last (its polling included:
        # a few microseconds a wake-up); the readings sit inside it.
        assert abs(measured - own) < 0.002, (own, measured)
    finally:
        child.stop(2)


# Waits for a file, spins 30 ms of its own CPU, prints the wall and CPU time the spin took.
SPINS_BUDGET = """
import os, sys, time
print("ready 0", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
wall, cpu = time.perf_counter_ns(), time.process_time_ns()
while time.process_time_ns() - cpu < 30_000_000:
    pass
print("spun", time.perf_counter_ns() - wall, time.process_time_ns() - cpu, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(
    not Path("/proc/self/task").exists() or not hasattr(os, "sched_setaffinity"),
    reason="Linux only",
)
def test_runq_wait_s_is_the_time_runnable_but_not_running(tmp_path: Path) -> None:
    """Two busy processes on the child's core: while it spins 30 ms of CPU it waits about twice
    that for the core, and ``runq_wait_s`` reads that wait (the spin's wall time less its CPU
    time), not its run time."""
    cpu = {min(os.sched_getaffinity(0))}
    log, go = tmp_path / "child.log", tmp_path / "go"
    busy = [
        Child.start(f"busy{i}", [sys.executable, "-c", "while True: pass"], tmp_path / f"b{i}", cpu)
        for i in range(2)
    ]
    child = Child.start("spins", [sys.executable, "-c", SPINS_BUDGET, str(go)], log, cpu)
    try:
        _line(log, "ready", child)
        before = child.runq_wait_s()
        go.touch()
        _line(log, "spun", child)
        after = child.runq_wait_s()
        wall_ns, cpu_ns = (int(x) for x in log.read_text().split("spun ")[1].split()[:2])
        assert before is not None and after is not None
        waited, off_cpu = after - before, (wall_ns - cpu_ns) / 1e9
        assert off_cpu > 0.04, (wall_ns, cpu_ns)  # the two busy processes took the core
        assert abs(waited - off_cpu) < 0.015, (waited, off_cpu)
    finally:
        child.stop(2)
        for one in busy:
            one.stop(1)
