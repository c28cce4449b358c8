"""The simulator as most engine_pool tests use it: the fast H100 profile at 100x, counting as
vLLM does, with the model's tokenizer and its own chat template (``engine_counter``); a test
needing another profile defines its own ``sim``."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from engine_pool.sim.server import SimServer, run_sim
from gateway.tools.sim_support import RegistryCounter


@pytest.fixture
async def sim(engine_counter: RegistryCounter) -> AsyncIterator[SimServer]:
    async with run_sim("h100-fast", time_scale=0.01, counter=engine_counter) as server:
        yield server
