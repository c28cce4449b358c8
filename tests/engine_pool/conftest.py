"""The simulator as most engine_pool tests use it: the fast H100 profile at 100x, counting with
the gateway's real tokenizer (a test needing another profile defines its own ``sim``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from engine_pool.sim.server import SimServer, run_sim
from gateway.count.tokens import TokenCounter
from gateway.tools.sim_support import RegistryCounter


@pytest.fixture
async def sim(counter: TokenCounter) -> AsyncIterator[SimServer]:
    async with run_sim(
        "h100-fast", time_scale=0.01, counter=RegistryCounter(counter, "qwen3.6")
    ) as server:
        yield server
