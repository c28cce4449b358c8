"""What the chain knows of a request (engine_pool/chain.py), as every filter and scorer reads it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import NamedTuple

from engine_pool.cluster import EngineView

# The default of every mapping below: empty and read-only (one shared by every ``Ask``).
_NONE: Mapping[str, int] = MappingProxyType({})


class Ask(NamedTuple):
    """What the chain knows of the request: its prompt plus the output room it needs (tokens;
    0 skips the context filter), the prefix tokens each endpoint (by URL) is believed to hold,
    and each endpoint's slot limit (None: the largest in-flight count among them, plus one).
    A named tuple, not a frozen dataclass, as ``EngineView``: one a request, and a frozen
    dataclass's ``__init__`` sets each field through ``object.__setattr__``."""

    tokens: int = 0
    need: int = 0
    cached: Mapping[str, int] = _NONE
    # Blocks the prefix index holds per endpoint URL: on a tie, the one holding least is the
    # new home of a prefix (homes spread by what they hold, not by the URL).
    held: Mapping[str, int] = _NONE
    limit_of: Callable[[EngineView], int] | None = None
    # Prompt tokens each endpoint (by URL) still has to prefill for the requests the gateway
    # sent it whose first token has not come back, less what it was believed to hold of them:
    # the prefill work queued ahead of this request there (engine_pool/prefill_ledger.py).
    pending: Mapping[str, int] = _NONE

    def uncached(self, view: EngineView) -> int:
        """Prompt tokens this request would prefill on ``view``: all but its cached prefix."""
        return max(0, self.tokens - self.cached.get(view.url, 0))

    def work(self, view: EngineView) -> int:
        """The prefill ahead of this request's first token on ``view``, in tokens: what the
        endpoint has pending, plus this request's own uncached part."""
        return self.pending.get(view.url, 0) + self.uncached(view)
