from __future__ import annotations

from typing import Any

import pytest

from tests.support.fake_engine import FakeEngine
from tests.support.servers import serve_asgi


@pytest.fixture
async def engine() -> Any:
    fake = FakeEngine()
    async with serve_asgi(fake) as url:
        yield fake, url
