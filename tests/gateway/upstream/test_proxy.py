"""gateway/upstream/proxy.py: the engine URL is split once per URL, and the split stays bounded."""

from __future__ import annotations

import pytest

from gateway.core.watchdog import Deadlines, Watch
from gateway.errors import UpstreamError
from gateway.upstream.http1 import Origin
from gateway.upstream.proxy import SPLIT_CACHE_URLS, Upstream


def test_the_split_of_an_engine_url_is_remembered_and_bounded() -> None:
    upstream = Upstream()
    url = "http://127.0.0.1:8000/v1/chat/completions"
    first = upstream._origin_of(url)
    assert first == Origin.of(url)
    assert upstream._origin_of(url) is first  # split once
    for i in range(SPLIT_CACHE_URLS + 5):
        upstream._origin_of(f"http://10.0.0.{i % 250}:{8000 + i}/v1/completions")
    assert len(upstream._split) <= SPLIT_CACHE_URLS


async def test_a_malformed_engine_url_is_an_upstream_error_every_time() -> None:
    upstream = Upstream()
    watch = Watch(Deadlines(connect_s=1, first_byte_s=1, idle_s=1, total_s=1))
    for _ in range(2):  # a failed split is never remembered as an answer
        with pytest.raises(UpstreamError, match="not an absolute"):
            async with upstream.open("ftp://engine/v1/x", b"{}", {}, watch):
                pass
    assert upstream._split == {}
