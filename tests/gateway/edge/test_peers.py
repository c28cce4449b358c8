"""gateway.edge.peers: the other workers' clients."""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs

from gateway.edge.peers import Peers
from gateway.observe.log import get_logger
from gateway.observe.metrics import Metrics
from gateway.slots.host import WorkerGroup


async def test_aclose_closes_every_client_when_one_fails_and_raises_the_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    peers = Peers(WorkerGroup(0, 3, tmp_path), get_logger("test"), Metrics(), lambda: None)
    first, second = peers._client(1), peers._client(2)

    async def refuse() -> None:
        raise RuntimeError("transport would not close")

    monkeypatch.setattr(first, "aclose", refuse)
    with capture_logs() as logs, pytest.raises(RuntimeError, match="would not close"):
        await peers.aclose()
    assert second.is_closed
    assert [(e["event"], e["worker"]) for e in logs] == [("peers.close_failed", 1)]
    monkeypatch.undo()
    await first.aclose()
