"""Two fake engines, one per lane, served on loopback sockets, for the request-path and the
routes tests (tests/gateway/request/, tests/gateway/protocols/)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.fake_engine import FakeEngine
from tests.support.servers import serve_asgi


@pytest.fixture
async def engines() -> Any:
    fast, heavy = FakeEngine(), FakeEngine()
    async with serve_asgi(fast) as fast_url, serve_asgi(heavy) as heavy_url:
        yield {"fast": (fast, fast_url), "heavy": (heavy, heavy_url)}
