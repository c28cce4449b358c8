"""The boot rehearsal: a burst of unique monsters through body read, parse and count, all at
once, before the app's startup completes (uvicorn accepts no connection before it)."""

from __future__ import annotations

import threading
from typing import Any

from structlog.testing import capture_logs

from gateway.count.tokenizers.worker import ChildEncoder
from gateway.edge.app import create_app
from gateway.request.rehearsal import MAX_BURST, burst_of
from gateway.settings import parse_settings
from tests.conftest import lanes_config


def _settings(heavy_slots: int, warmup_tokens: int | None = 200_000) -> Any:
    config = lanes_config(["http://127.0.0.1:9"], ["http://127.0.0.1:9"])
    config["lanes"][1]["slots"] = {"lane": heavy_slots, "per_endpoint": heavy_slots}
    config["counting"] = {"warmup_tokens": warmup_tokens}
    return parse_settings(config, environ={})


def test_the_burst_is_the_widest_lanes_slots_capped() -> None:
    assert burst_of(_settings(2)) == 2
    assert burst_of(_settings(64)) == MAX_BURST


async def test_startup_counts_a_concurrent_burst_of_unique_monsters_before_it_completes() -> None:
    settings = _settings(3)
    app = create_app(settings)
    encoder = app.gateway.counter._model("qwen3.6").vocab.encoder
    assert isinstance(encoder, ChildEncoder)
    calls: list[tuple[str, int]] = []
    real = encoder.count_many

    def spy(texts: Any) -> list[int]:
        calls.append((threading.current_thread().name, sum(len(t) for t in texts)))
        return real(texts)

    encoder.count_many = spy  # type: ignore[method-assign]
    try:
        with capture_logs() as logs:
            async with app.api.router.lifespan_context(app.api):
                started = [e["event"] for e in logs]
                # Startup is over (uvicorn would now accept connections): rehearsed already.
                assert "tokenizer.rehearsed" in started
    finally:
        encoder.count_many = real  # type: ignore[method-assign]
    rehearsed = next(e for e in logs if e["event"] == "tokenizer.rehearsed")
    assert rehearsed["burst"] == 3 and rehearsed["tokens"] == 200_000
    # Three unique monsters, each counted by the tokenizer child from the counting thread (the
    # hand-off a request's count takes), none from the event loop's thread.
    monsters = [(thread, size) for thread, size in calls if size > 300_000]
    assert len(monsters) == 3, calls
    assert all(thread.startswith("count") for thread, _ in monsters), monsters


async def test_no_rehearsal_when_the_warm_up_is_off() -> None:
    app = create_app(_settings(3, warmup_tokens=0))
    with capture_logs() as logs:
        async with app.api.router.lifespan_context(app.api):
            pass
    assert not [e for e in logs if e["event"] == "tokenizer.rehearsed"]
