"""Redis for the integration tests: the one on 127.0.0.1:6379 if it answers PING, else a
``redis-server`` started on a free port for the session. Every test gets its own key prefix,
deleted afterwards, so runs never collide. Tests that stop or freeze Redis start their own
(``redis_support.own_redis``), never the shared one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.redis_support import delete_prefix, new_prefix, shared_or_own_redis


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with shared_or_own_redis() as url:
        yield url


@pytest.fixture
def prefix(redis_url: str) -> Iterator[str]:
    name = new_prefix()
    yield name
    delete_prefix(redis_url, name)
