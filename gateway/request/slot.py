"""A granted slot as a request holds it (``Held``), and the context that holds it for the
block (``Slot``, what ``Admission.slot`` returns): waited for on entry, released on every way
out, an exception or a cancellation included (the structural release).

    async with admission.slot(lane, candidates, token, limit_of) as held:   # a Slot
        held.grant                                   the grant in force (``move`` may replace it)

The waiting and the store's steps are gateway/request/admission.py's; ``Slot`` adds the
bookkeeping around them: the reservation a borrower never keeps past its wait, the slot and
borrowing gauges, a shared store's lease renewal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from typing import NamedTuple, Protocol

from engine_pool.cluster import EngineView
from gateway.core.decision import Grant
from gateway.observe.metrics import Metrics
from gateway.request.borrowing import Loan
from gateway.request.lending import Lending
from gateway.settings import ClassSettings, LaneSettings
from gateway.slots.store import SlotStore

# An endpoint's slot limit in a lane (gateway/request/lanes.py ``endpoint_limit``).
LimitOf = Callable[[EngineView], int]
NO_CLASSES = ClassSettings()


class Want(NamedTuple):
    """What a request brings to admission besides its lane: its class and the loans open to it
    (``lent()`` lists the lenders' endpoints as (view, loan), asked on every try). A named
    tuple, not a frozen dataclass: one a request, and a frozen dataclass's ``__init__`` sets
    each field through ``object.__setattr__``."""

    priority: str = NO_CLASSES.default
    classes: ClassSettings = NO_CLASSES
    loans: tuple[Loan, ...] = ()
    lent: Callable[[], Sequence[tuple[EngineView, Loan]]] = lambda: ()

    @property
    def rank(self) -> int:
        return self.classes.names.index(self.priority)


class Admits(Protocol):
    """What a ``Slot`` uses of its admission (gateway/request/admission.py ``Admission``)."""

    lending: Lending
    store: SlotStore
    borrowing: dict[tuple[str, str], int]
    _metrics: Metrics

    async def _acquire(
        self,
        lane: LaneSettings,
        candidates: Callable[[], Sequence[EngineView]],
        token: str,
        limit_of: LimitOf,
        want: Want,
    ) -> Grant: ...

    async def _release(self, token: str, keys: Sequence[str], lane: str) -> None: ...


class Held:
    """A granted slot as the request holds it: the current grant, which ``move`` may replace."""

    __slots__ = ("_stack", "grant", "moves")

    def __init__(self, grant: Grant) -> None:
        self.grant = grant
        self.moves = 0
        self._stack = AsyncExitStack()

    @property
    def token(self) -> str:
        return self.grant.token

    @property
    def lane(self) -> str:
        return self.grant.lane

    @property
    def cluster(self) -> str:
        return self.grant.cluster

    @property
    def url(self) -> str:
        return self.grant.url

    @property
    def keys(self) -> tuple[str, ...]:
        return self.grant.keys

    @property
    def queued_s(self) -> float:
        return self.grant.queued_s


class Slot:
    """``Admission.slot``'s context: a class, not an ``asynccontextmanager`` (its generator,
    the loop's async-generator hook and two ``anext`` a request). ``__aexit__`` runs on every
    way out of the block, an exception or a cancellation included, as a generator's ``finally``
    did: the structural release."""

    __slots__ = (
        "_admission",
        "_candidates",
        "_held",
        "_lane",
        "_leased",
        "_lender",
        "_limit_of",
        "_token",
        "_want",
    )

    def __init__(
        self,
        admission: Admits,
        lane: LaneSettings,
        candidates: Callable[[], Sequence[EngineView]],
        token: str,
        limit_of: LimitOf,
        want: Want,
    ) -> None:
        self._admission, self._lane, self._candidates = admission, lane, candidates
        self._token, self._limit_of, self._want = token, limit_of, want
        self._held: Held | None = None
        self._lender: str | None = None
        self._leased = False

    async def __aenter__(self) -> Held:
        admission, lane, token = self._admission, self._lane, self._token
        want = self._want
        try:
            held = Held(
                await admission._acquire(lane, self._candidates, token, self._limit_of, want)
            )
        finally:
            # Granted, refused, timed out or cancelled: a reservation never outlives the wait.
            if admission.lending.holds(token):
                await admission.lending.unreserve(token, lane.name)
        grant = held.grant
        lender = self._lender = grant.lender
        m = admission._metrics
        m.child(m.slots_in_use, grant.lane, grant.cluster).inc()
        if lender is not None:
            m.borrowed.labels(lane=grant.lane, lender=lender).inc()
            m.borrowers_in_flight.labels(lane=grant.lane, lender=lender).inc()
            key = (grant.lane, lender)
            admission.borrowing[key] = admission.borrowing.get(key, 0) + 1
        self._held = held
        # Only a shared store has a lease to renew: an in-process store's hold is empty, and its
        # context (two generator context managers a request) is skipped.
        if admission.store.shared:
            self._leased = True
            try:
                await held._stack.enter_async_context(admission.store.hold(grant.token, grant.keys))
            except BaseException:
                await self.__aexit__(None, None, None)
                raise
        return held

    async def __aexit__(self, *exc_info: object) -> None:
        held, lender, leased = self._held, self._lender, self._leased
        assert held is not None, "exited a slot never entered"
        self._held = None
        admission = self._admission
        m = admission._metrics
        try:
            if leased:
                await held._stack.aclose()
        finally:
            grant = held.grant  # the one it holds now: a failover may have moved it
            m.child(m.slots_in_use, grant.lane, grant.cluster).dec()
            await admission._release(grant.token, grant.keys, lane=grant.lane)
            if lender is not None:
                m.borrowers_in_flight.labels(lane=grant.lane, lender=lender).dec()
                admission.borrowing[(grant.lane, lender)] -= 1
