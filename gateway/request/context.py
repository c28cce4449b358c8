"""One request's context: what it arrived with and what each step of its lifecycle decided.

The pipeline (gateway/request/pipeline.py) makes one ``RequestContext`` when the body is read
and hands it to each step instead of a chain of parameters. The fields a step decides are set
once, by that step, and only read after it (README "Request lifecycle"):

    arrival     policy, route, scope, out, record, body
    2 parse     request, model
    3-4 decide  count, decision, pinned, want
    5 admit     lane, exact, watch, relay (a stream that may migrate), sent (the body the engine
                gets: the original, then a continuation after a migration)

``Target`` is one attempt's part: the endpoint its slot holds and that cluster's settings.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from gateway.core.count import TokenCount
from gateway.core.decision import Decision, Grant
from gateway.core.exchange import Outbound, Scope
from gateway.core.watchdog import Watch
from gateway.count.usage import ExactCount
from gateway.observe.record import Record
from gateway.protocols.openai import RoutedRequest
from gateway.protocols.routes import EngineRoute
from gateway.request.policy import Policy
from gateway.request.relay import Relay
from gateway.request.slot import Want
from gateway.settings import ClusterSettings, LaneSettings, ModelSettings


@dataclass(slots=True)
class RequestContext:
    # Arrival. The policy is read once: the request finishes under the one that admitted it.
    policy: Policy
    route: EngineRoute
    scope: Scope
    out: Outbound
    record: Record
    body: bytes
    # Step 2, parse.
    request: RoutedRequest = field(init=False)
    model: ModelSettings = field(init=False)
    # Steps 3 and 4: the count and the lane decision (pinned: a Responses follow-up's endpoint).
    count: TokenCount = field(init=False)
    decision: Decision = field(init=False)
    pinned: str | None = None
    want: Want = field(init=False)
    # Step 5: the lane it was admitted to, its exact count to come, the deadlines of every
    # attempt (failing over never extends them), the relay of a stream that may migrate.
    lane: LaneSettings = field(init=False)
    exact: ExactCount = field(init=False)
    watch: Watch = field(init=False)
    relay: Relay | None = None
    sent: bytes = b""
    # The engine path ``sent`` goes to when not the client's (a continuation from token ids).
    sent_path: str | None = None
    # Step 7: called at the answer's first chunk (the engine has prefilled the prompt): the
    # prefill ledger (engine_pool/prefill_ledger.py) forgets the request's pending tokens.
    prefilled: Callable[[], None] = lambda: None
    # The running loop, asked once by the pipeline and handed to the request's cancel scopes
    # (a getpid system call each time it is asked, in Python 3.11); None: they ask themselves.
    loop: asyncio.AbstractEventLoop | None = None

    @property
    def request_id(self) -> str:
        return self.record.request_id


class Target(NamedTuple):
    """One attempt: the endpoint its slot holds, that cluster's auth settings and engine key,
    and whether to open a new connection (a kept-alive one was found closed). A named tuple,
    not a frozen dataclass: one an attempt, and a frozen dataclass's ``__init__`` sets each
    field through ``object.__setattr__``."""

    grant: Grant
    cluster: ClusterSettings
    engine_key: str | None
    fresh: bool
