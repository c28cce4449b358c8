"""The other workers of this gateway, asked over their private unix sockets
(gateway/edge/workers.py).

A request to ``/metrics``, ``/admin/state``, ``/admin/dashboard.json`` or ``POST /admin/reload``
lands on one worker; that worker answers for the whole gateway by asking every peer the same
request with ``x-shapegate-scope: worker`` (answer for yourself only) and merging the answers
(gateway/edge/admin/merge.py), or, for a reload, passing the same policy on.

Contract of ``Peers.ask(method, path, ...)``: one ``Answer`` per peer, in worker order, with the
response or None when that worker could not answer within ``timeout_s`` (it may be restarting:
gateway/edge/workers.py starts it again). A failure is logged and counted (``swallowed``), never
raised: a gateway-wide view of the workers that answered beats none, and the merged metrics
say how many did (``shapegate_workers{state="answered"}``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import anyio
import httpx

from gateway.core.exchange import Scope, header
from gateway.observe.log import Logger, swallowed
from gateway.observe.metrics import Metrics
from gateway.slots.host import WorkerGroup

SCOPE_HEADER = "x-shapegate-scope"
TIMEOUT_S = 2.0


def worker_only(scope: Scope) -> bool:
    """The request asks this worker for its own view, not the gateway's."""
    return header(scope, SCOPE_HEADER.encode()) == b"worker"


@dataclass(frozen=True, slots=True)
class Answer:
    worker: int
    response: httpx.Response | None


class Peers:
    def __init__(
        self,
        group: WorkerGroup,
        log: Logger,
        metrics: Metrics,
        token_of: Callable[[], str | None],
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        self.group = group
        self._log = log
        self._metrics = metrics
        self._token_of = token_of
        self._timeout_s = timeout_s
        self._clients: dict[int, httpx.AsyncClient] = {}

    def _client(self, index: int) -> httpx.AsyncClient:
        client = self._clients.get(index)
        if client is None:
            transport = httpx.AsyncHTTPTransport(uds=str(self.group.peer_socket(index)))
            client = httpx.AsyncClient(
                transport=transport, base_url="http://localhost", timeout=self._timeout_s
            )
            self._clients[index] = client
        return client

    def _headers(self, extra: dict[str, str]) -> dict[str, str]:
        headers = {SCOPE_HEADER: "worker", "x-shapegate-admin": "1", **extra}
        token = self._token_of()
        if token is not None:
            headers["authorization"] = f"Bearer {token}"
        return headers

    async def ask(
        self,
        method: str,
        path: str,
        content: bytes = b"",
        headers: dict[str, str] | None = None,
    ) -> list[Answer]:
        answers: dict[int, httpx.Response | None] = {}

        async def one(index: int) -> None:
            try:
                answers[index] = await self._client(index).request(
                    method, path, content=content, headers=self._headers(headers or {})
                )
            except httpx.HTTPError as exc:
                answers[index] = None
                swallowed(
                    self._log,
                    self._metrics,
                    "peers.ask",
                    exc,
                    decision="view_without_worker",
                    worker=index,
                    path=path,
                )

        async with anyio.create_task_group() as group:
            for index in self.group.peers:
                group.start_soon(one, index)
        return [Answer(i, answers.get(i)) for i in self.group.peers]

    async def aclose(self) -> None:
        """Close every peer client: one that fails leaves the others to close all the same
        (logged each), and the first failure is raised once all were tried, as
        ``Gateway.aclose`` does with the gateway's services."""
        failed: Exception | None = None
        for index, client in self._clients.items():
            try:
                await client.aclose()
            except Exception as exc:  # noqa: BLE001 - logged, raised after the rest
                self._log.warning("peers.close_failed", worker=index, error=repr(exc))
                failed = failed or exc
        if failed is not None:
            raise failed
