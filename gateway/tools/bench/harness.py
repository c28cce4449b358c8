"""What the process-level suites (overhead, memory) share: the machine, ports, child processes.

- ``machine()``: CPU model, cores, load average now, Python; every suite's JSON carries it.
- ``Child``: a process started with ``sys.executable``, optionally pinned to CPUs, stdout to a
  file; ``cpu_s()`` the run time of every thread of the process (schedstat, nanoseconds) and
  ``pss_mb()`` the proportional set sizes of the process and its descendants (the tokenizer
  template and counting children: ``tree_pss_mb``, a page they share counted once;
  ``tree_rss_mb`` counts it in each: ~140 MB too many on the demo policy); ``stop()`` sends
  SIGINT, then kills after a grace period.
- ``start_upstream(folder, cpus, chunks)``: the fixed fast upstream (``upstream.py``).
- ``start_smg(upstream_port, folder, cpus)``: SGLang's Rust model gateway (PyPI ``smg``, the
  bench extra) in front of the same upstream, as ``smg launch --policy round_robin`` with the
  upstream as its one worker; returns once it routes a chat request (it discovers the model from
  the upstream's ``/v1/models``), or None when ``smg`` is not installed.
- ``start_gateway(config, folder, cpus)``: ``shapegate serve`` on a policy written to
  ``folder/gateway.yaml``; returns once ``/readyz`` answers 200 (the boot probe passed).
- ``gateway_rig(pin, chunks=..., smg=False)``: both of them (and smg beside the gateway, on the
  gateway's CPU, when asked and installed) in a temporary folder, on their own CPUs when pinned
  (this process on the upstream's); everything stopped and unpinned when the block ends.
- ``write_json(out, name, result)``: ``out/name.json``, indented; ``publish`` adds the plot and
  prints the table.
"""

from __future__ import annotations

import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import IO, Any

import orjson
import yaml


def descendants(pid: int) -> list[int]:
    """A process and all its descendants, those alive now (Linux /proc)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        try:
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children", "rb") as children:
                    todo.extend(int(c) for c in children.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue  # it exited between two reads
        found.append(current)
    return found


def tree_pss_mb(pid: int | None = None) -> float:
    """The memory of a process and all its descendants, MB: the sum of their proportional set
    sizes (``Pss`` in /proc/PID/smaps_rollup), so a page shared by several of them (the
    tokenizer template's, copied on write into each counting child) is counted once in all.
    Where smaps_rollup is missing, resident memory (which counts shared pages in each)."""
    total_kb = 0
    for current in descendants(os.getpid() if pid is None else pid):
        try:
            with open(f"/proc/{current}/smaps_rollup", "rb") as rollup:
                total_kb += next(
                    int(line.split()[1]) for line in rollup if line.startswith(b"Pss:")
                )
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue  # it exited between two reads
        except PermissionError:
            with open(f"/proc/{current}/statm", "rb") as statm:
                total_kb += int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    return total_kb / 1024


def tree_rss_mb(pid: int | None = None) -> float:
    """Resident memory of a process and all its descendants, MB (Linux /proc): a page several
    of them share counts in each."""
    total = 0
    for current in descendants(os.getpid() if pid is None else pid):
        try:
            with open(f"/proc/{current}/statm", "rb") as statm:
                total += int(statm.read().split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue  # it exited between two reads
    return total * os.sysconf("SC_PAGE_SIZE") / 2**20


def machine() -> dict[str, Any]:
    model = platform.processor() or "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text(encoding="utf-8").splitlines() if cpuinfo.is_file() else []
    model = next(
        (line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), model
    )
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "platform": platform.platform(),
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def pin_self(cpus: set[int] | None) -> set[int] | None:
    """Pin every thread of this process to ``cpus``; returns the previous set to restore."""
    if cpus is None or not hasattr(os, "sched_setaffinity"):
        return None
    before = os.sched_getaffinity(0)
    for tid in (int(t) for t in os.listdir("/proc/self/task")):
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            continue  # the thread ended between the listing and the call
    return before


def two_core_plan(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """(gateway CPUs, load generator + upstream CPUs): one core each when there are two."""
    if not pin or not hasattr(os, "sched_getaffinity"):
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    return {cpus[0]}, {cpus[1]}


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    _log: IO[bytes]

    @classmethod
    def start(cls, name: str, argv: list[str], log_path: Path, cpus: set[int] | None) -> Child:
        log = log_path.open("wb")

        def pin() -> None:  # in the child, before exec: a runtime sizing its thread pool by
            if cpus is not None:  # the CPUs it may use (tokio, smg's) sees the pinned set
                os.sched_setaffinity(0, cpus)

        # pin() makes one system call and takes no lock: safe between fork and exec.
        process = subprocess.Popen(  # noqa: S603 - our own interpreter and module, or smg
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=pin,  # noqa: PLW1509
        )
        return cls(name, process, log_path, log)

    @property
    def pid(self) -> int:
        return self.process.pid

    def cpu_s(self) -> float:
        """CPU seconds the process's threads have run, to the nanosecond: the sum of each
        live thread's ``/proc/PID/task/TID/schedstat`` run time. ``/proc/PID/stat``'s
        utime + stime count in clock ticks (10 ms): over a round of 600 requests that is
        17 us a request of rounding, as large as the effects measured (a shadow policy's
        ~30 us). A thread that exited is not counted (the gateway's threads live as long as
        it does); without schedstat (a kernel built without it), the ticks."""
        ran = self._schedstat(0)
        if ran is not None:
            return ran
        with open(f"/proc/{self.pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def runq_wait_s(self) -> float | None:
        """Seconds the process's threads were runnable but waited for a CPU (the second field
        of each live thread's ``/proc/PID/task/TID/schedstat``), summed over its threads: while
        another process ran on its core, or another of its own threads did (a runtime of
        several threads pinned to one core waits on itself). None without schedstat."""
        return self._schedstat(1)

    def _schedstat(self, field: int) -> float | None:
        """The sum over the live threads of one ``schedstat`` field, in seconds; None without
        schedstat."""
        tasks = f"/proc/{self.pid}/task"
        total_ns, found = 0, False
        for tid in os.listdir(tasks):
            try:
                with open(f"{tasks}/{tid}/schedstat", encoding="ascii") as stat:
                    total_ns += int(stat.read().split()[field])
                found = True
            except (FileNotFoundError, ProcessLookupError):
                continue  # the thread ended between the listing and the read
        return total_ns / 1e9 if found else None

    def pss_mb(self) -> float:
        """Memory of the process and its descendants (the gateway's tokenizer template and
        counting children included), a page the template shares with a child copy-on-write
        counted once (``tree_pss_mb``)."""
        return tree_pss_mb(self.pid)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace_s: float = 10.0) -> int | None:
        if self.alive():
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self._log.close()
        return self.process.returncode


def start_upstream(folder: Path, cpus: set[int] | None, chunks: int = 100) -> tuple[Child, int]:
    port = free_port()
    argv = [sys.executable, "-m", "gateway.tools.bench.upstream", "--port", str(port)]
    argv += ["--chunks", str(chunks)]
    child = Child.start("upstream", argv, folder / "upstream.log", cpus)
    wait_http(f"http://127.0.0.1:{port}/health", child, 20.0)
    return child, port


def smg_command() -> str | None:
    """The ``smg`` launcher of this interpreter's environment, else one on PATH, else None."""
    beside = Path(sys.executable).parent / "smg"
    return str(beside) if beside.is_file() else shutil.which("smg")


SMG_PROBE = b'{"model":"qwen3.6","max_tokens":1,"messages":[{"role":"user","content":"ready?"}]}'


def start_smg(upstream_port: int, folder: Path, cpus: set[int] | None) -> tuple[Child, int] | None:
    command = smg_command()
    if command is None:
        return None
    port = free_port()
    argv = [
        command,
        "launch",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        f"http://127.0.0.1:{upstream_port}",
        "--policy",
        "round_robin",
        # Its Prometheus listener defaults to 0.0.0.0:29000: a second smg on the machine (or a
        # second run) would fail to start on it.
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
    ]
    child = Child.start("smg", argv, folder / "smg.log", cpus)
    # Ready once a chat request is routed: it registers the worker and discovers its model in
    # the background after it starts listening.
    wait_http(f"http://127.0.0.1:{port}/v1/chat/completions", child, 60.0, SMG_PROBE)
    return child, port


def gateway_policy(upstream_port: int, port: int, *, ring: int = 200) -> dict[str, Any]:
    """One lane over one fast upstream, limits far above the offered load (we measure the
    gateway's own cost, not its queueing policy), the demo's tokenizer."""
    return {
        "server": {"host": "127.0.0.1", "port": port, "decision_ring_size": ring},
        "models": [
            {
                "name": "qwen3.6",
                "tokenizer": {"source": "builtin", "name": "qwen3.6", "chat_template": "chatml"},
            }
        ],
        "clusters": [
            {"name": "fast", "kind": "vllm", "endpoints": [f"http://127.0.0.1:{upstream_port}"]}
        ],
        "lanes": [
            {
                "name": "fast",
                "min_prompt_tokens": 0,
                "max_prompt_tokens": 32768,
                "clusters": ["fast"],
                "slots": {"lane": 4096, "per_endpoint": 4096},
                "queue": {"depth": 4096, "max_wait_s": 30},
            },
            {
                "name": "heavy",
                "min_prompt_tokens": 32768,
                "max_prompt_tokens": 1048576,
                "clusters": ["fast"],
                "slots": {"lane": 64, "per_endpoint": 64},
            },
        ],
        "state": {"backend": "memory"},
    }


def start_gateway(policy: dict[str, Any], folder: Path, cpus: set[int] | None) -> Child:
    path = folder / "gateway.yaml"
    path.write_text(yaml.safe_dump(policy), encoding="utf-8")
    argv = [sys.executable, "-m", "gateway.tools.cli", "serve", "--config", str(path)]
    child = Child.start("gateway", argv, folder / "gateway.log", cpus)
    port = policy["server"]["port"]
    wait_http(f"http://127.0.0.1:{port}/readyz", child, 60.0)
    return child


@dataclass(frozen=True, slots=True)
class Rig:
    folder: Path
    upstream_port: int
    gateway: Child
    gateway_port: int
    gateway_cpus: set[int] | None
    load_cpus: set[int] | None
    smg: Child | None = None
    smg_port: int = 0


@contextmanager
def gateway_rig(pin: bool, *, chunks: int = 100, smg: bool = False) -> Iterator[Rig]:
    gateway_cpus, load_cpus = two_core_plan(pin)
    restore = pin_self(load_cpus)
    try:
        with tempfile.TemporaryDirectory(prefix="shapegate-bench-") as tmp:
            folder = Path(tmp)
            upstream, upstream_port = start_upstream(folder, load_cpus, chunks)
            gateway: Child | None = None
            peer: tuple[Child, int] | None = None
            try:
                port = free_port()
                gateway = start_gateway(gateway_policy(upstream_port, port), folder, gateway_cpus)
                peer = start_smg(upstream_port, folder, gateway_cpus) if smg else None
                yield Rig(
                    folder,
                    upstream_port,
                    gateway,
                    port,
                    gateway_cpus,
                    load_cpus,
                    *(peer or (None, 0)),
                )
            finally:
                if peer is not None:
                    peer[0].stop()
                if gateway is not None:
                    gateway.stop()
                upstream.stop()
    finally:
        pin_self(restore)


def wait_http(url: str, child: Child, timeout_s: float, post: bytes | None = None) -> None:
    """Until ``url`` answers 200 (a GET, or a JSON POST of ``post``); the child stopped and
    ``RuntimeError`` if it exits first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    headers = {"content-type": "application/json"}
    while time.monotonic() < deadline:
        if not child.alive():
            raise RuntimeError(f"{child.name} exited; see {child.log_path}")
        request = urllib.request.Request(  # noqa: S310 - a loopback http URL of ours
            url, data=post, headers=headers if post else {}
        )
        try:
            with urllib.request.urlopen(request, timeout=1) as response:  # noqa: S310 - loopback
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            time.sleep(0.1)
    child.stop()
    raise RuntimeError(f"{child.name} not ready at {url} within {timeout_s:g}s")


def write_json(out: Path, name: str, result: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    return path


def target_lines(targets: list[dict[str, Any]]) -> list[str]:
    """One line a target: met or MISS, the value and the limit."""
    return [
        f"{'met ' if t['met'] else 'MISS'} {t['target']}: {t['value']} (limit {t['limit']})"
        for t in targets
    ]


def publish(
    out: str, name: str, result: dict[str, Any], table: str, plot: Callable[[Path], None]
) -> int:
    """Write ``<out>/<name>.json`` and ``<out>/<name>.png``, print the table; exit code 0."""
    folder = Path(out)
    path = write_json(folder, name, result)
    image = folder / f"{name}.png"
    plot(image)
    print(table)
    print(f"\nwritten: {path}, {image}")
    return 0


def package_version(name: str) -> str:
    """The installed version of a distribution, or "absent"."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def with_targets(lines: list[str], targets: list[dict[str, Any]]) -> str:
    """A suite's report: its lines, a blank line, then one line a target."""
    return "\n".join([*lines, "", *target_lines(targets)])


def machine_line(info: dict[str, Any]) -> str:
    load = ", ".join(f"{x:g}" for x in info["load_average"])
    return f"machine: {info['cpu']}, {info['cores']} cores, load average {load} at start"
