from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import hypothesis
import pytest

from engine_pool.sim.profile import load_profile
from engine_pool.sim.server import SimServer, run_sim
from gateway.count.tokens import TokenCounter
from gateway.edge.app import create_app
from gateway.settings import Settings, parse_settings
from gateway.tools.sim_support import RegistryCounter
from tests.support.checkout import checkout_env
from tests.support.servers import serve_asgi

ROOT = Path(__file__).resolve().parent.parent
MODEL = {
    "name": "qwen3.6",
    "aliases": ["Qwen/Qwen3.6-35B-A3B"],
    "tokenizer": {"source": "builtin", "name": "qwen3.6", "chat_template": "chatml"},
    "max_model_len": 1_048_576,
}


# The Content-Type every JSON route requires (a missing or other one is answered 415).
JSON = {"content-type": "application/json"}
# What a state-changing admin request carries without a bearer token
# (gateway/edge/admin/guard.py).
ADMIN = {"content-type": "application/yaml", "x-shapegate-admin": "1"}
# scripts/mutate wants "killed or not", not the smallest failing example: no shrinking there.
hypothesis.settings.register_profile(
    "mutate", phases=[hypothesis.Phase.explicit, hypothesis.Phase.reuse, hypothesis.Phase.generate]
)

# A `shapegate` that only fails, first on PATH for the whole run: a test that starts the
# installed entry point instead of the checkout (tests/support/checkout.py) fails loudly.
POISON_SHAPEGATE = (
    "#!/bin/sh\necho 'tests run the checkout: use tests.support.checkout' >&2\nexit 1\n"
)


@pytest.fixture(scope="session", autouse=True)
def installed_shapegate_fails(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """For the whole run: the poisoned `shapegate` first on PATH, and the checkout first on
    PYTHONPATH, so every ``python -m gateway...`` a test or the code under test starts (demo
    engines, benchmark children) imports this tree, whatever the venv has installed."""
    poison = tmp_path_factory.mktemp("poisoned-path")
    script = poison / "shapegate"
    script.write_text(POISON_SHAPEGATE)
    script.chmod(0o755)
    saved = {name: os.environ.get(name) for name in ("PATH", "PYTHONPATH")}
    os.environ.update(checkout_env())
    os.environ["PATH"] = os.pathsep.join([str(poison), saved["PATH"] or ""])
    try:
        yield script
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def lanes_config(
    fast: list[str], heavy: list[str], threshold: int = 2000, **overrides: Any
) -> dict[str, Any]:
    """A two-lane policy in front of the given endpoints, small enough for fast tests."""
    config: dict[str, Any] = {
        "server": {"boot_probe": False},
        "models": [MODEL],
        "clusters": [
            {"name": "fast", "endpoints": fast},
            {"name": "heavy", "endpoints": heavy},
        ],
        "lanes": [
            {
                "name": "fast",
                "max_prompt_tokens": threshold,
                "clusters": ["fast"],
                "slots": {"lane": 64, "per_endpoint": 32},
                "queue": {"depth": 512, "max_wait_s": 10},
                "timeouts": {"connect_s": 2, "first_byte_s": 5, "idle_s": 5, "total_s": 30},
            },
            {
                "name": "heavy",
                "min_prompt_tokens": threshold,
                "max_prompt_tokens": 1_000_000,
                "clusters": ["heavy"],
                "slots": {"lane": 4, "per_endpoint": 4},
                "queue": {"depth": 64, "max_wait_s": 10},
                "timeouts": {"connect_s": 2, "first_byte_s": 5, "idle_s": 5, "total_s": 30},
            },
        ],
    }
    for key, value in overrides.items():
        config[key] = value
    return config


@pytest.fixture(scope="session")
def counter() -> TokenCounter:
    """The demo tokenizers, loaded once for the whole run (loading is a start-up cost)."""
    return TokenCounter.from_settings(
        parse_settings(lanes_config(["http://x"], ["http://y"]), environ={})
    )


@pytest.fixture(scope="session")
def engine_counter() -> RegistryCounter:
    """What a simulated engine counts with when nothing else is asked: its profile's tokenizer
    and the model's own chat template (``hf``), as vLLM renders it ("hello" is 11 tokens, where
    the gateway's ChatML policy above counts 9). Loaded once for the whole run."""
    return RegistryCounter.for_profile(load_profile("h100-fast"))


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "qwen3.6", "messages": [{"role": "user", "content": text}], **extra}


@pytest.fixture
async def sims(counter: TokenCounter) -> AsyncIterator[tuple[SimServer, SimServer]]:
    """A fast-lane and a heavy-lane simulated engine sharing the session's tokenizer."""
    shared = RegistryCounter(counter, "qwen3.6")
    async with (
        run_sim("h100-fast", time_scale=0.2, counter=shared, seed=1) as fast,
        run_sim("h100-heavy", time_scale=0.2, counter=shared, seed=2) as heavy,
    ):
        yield fast, heavy


GatewayFactory = Callable[[dict[str, Any]], Any]


@pytest.fixture
def gateway_at(counter: TokenCounter) -> Callable[[dict[str, Any]], Any]:
    """``async with gateway_at(config) as (url, app_settings)``: a real gateway on a socket."""

    @asynccontextmanager
    async def start(config: dict[str, Any]) -> AsyncIterator[tuple[str, Settings]]:
        settings = parse_settings(config, environ={})
        async with serve_asgi(create_app(settings, counter)) as url:
            yield url, settings

    return start


# Tests that measure time (a release within 1 s, a TTFT ratio, a p99, a cost fit): scripts/check
# runs them alone after the rest, which it runs on two workers, so no other test shares their
# cores. A node id, or a file for all of its tests.
SERIAL = (
    "tests/reliability/test_disconnect_storm.py",
    "tests/security/test_hostile_input.py::test_slowloris_is_cut_at_the_header_deadline_and_others_are_unaffected",
    "tests/gateway/tuning/test_live_replay.py",
    "tests/gateway/upstream/test_engine_watch.py::test_an_engine_slow_to_first_token_among_its_peers_is_shown_slow_and_still_routed",
    "tests/gateway/observe/test_metrics.py::test_ttft_itl_and_tokens_are_observed_per_lane",
    "tests/gateway/request/test_classes_live.py",
    "tests/gateway/request/test_borrowing_live.py",
    "tests/gateway/request/test_lanes_hol.py",
    "tests/gateway/request/test_slot_accounting.py::test_a_few_hundred_mixed_requests_leave_no_slot_behind",
    "tests/reliability/test_graceful_shutdown.py",
    # Replicas at a 1 s lease TTL and a 0.5 s Redis deadline: on two cores shared with the
    # parallel phase, two of them missed a window in two CI runs (2026-12-01), never alone.
    "tests/integration/test_redis_gateways.py",
    # A first count against a warm median (2x) and a Sentinel failover at a 1.5 s lease TTL:
    # both missed their window once in the parallel phase of a clean-clone run (2026-12-02).
    "tests/gateway/count/test_tokens_warmup.py::test_the_first_300k_token_prompt_after_boot_counts_within_2x_of_the_warm_p50",
    "tests/integration/test_redis_sentinel.py",
    # A dead replica's waiter lapses within its 0.3 s lease (+0.2 s): 0.63 s once beside the
    # parallel phase and three other jobs (2026-12-05), never alone.
    "tests/integration/test_redis_store.py::test_a_dead_replicas_waiters_stop_holding_up_the_queue",
    # A lookup timed against 2 ms, and agents' homes under concurrency (issue 32).
    "tests/engine_pool/test_prefix_index.py::test_lookup_of_a_200k_token_prompt_is_under_2_ms",
    "tests/gateway/request/test_prefix.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        nodeid = item.nodeid.split("[")[0]
        if any(nodeid == s or nodeid.startswith(s + "::") for s in SERIAL):
            item.add_marker(pytest.mark.serial)
