"""The prefill work the gateway has sent each endpoint and not yet seen done. Pure data.

    ledger = PrefillLedger()
    ledger.add(key, url, tokens)   a request sent to ``url`` that must prefill ``tokens`` (its
                                   prompt less the prefix the endpoint was believed to hold);
                                   a key added again moves (failover, migration)
    ledger.done(key)               its first token came back, or it ended: forgotten
                                   (idempotent; an unknown key is ignored)
    ledger.pending                 URL -> prompt tokens still to prefill there

The endpoint chain reads ``pending`` (``Ask.pending``, engine_pool/chain.py ``_hold``): the
prefill queued ahead of a new request on an endpoint, so a full home busy with cached follow-ups
(little pending) is worth waiting for, and one busy prefilling a new 300k-token document is not.
Its size is the requests in flight: every key is removed when its request ends.
"""

from __future__ import annotations

from collections.abc import Mapping


class PrefillLedger:
    def __init__(self) -> None:
        self._of: dict[str, tuple[str, int]] = {}
        self._pending: dict[str, int] = {}

    @property
    def pending(self) -> Mapping[str, int]:
        return self._pending

    def __len__(self) -> int:
        return len(self._of)

    def add(self, key: str, url: str, tokens: int) -> None:
        self.done(key)
        tokens = max(0, tokens)
        self._of[key] = (url, tokens)
        if tokens:
            self._pending[url] = self._pending.get(url, 0) + tokens

    def done(self, key: str) -> None:
        entry = self._of.pop(key, None)
        if entry is None:
            return
        url, tokens = entry
        if not tokens:
            return
        left = self._pending[url] - tokens
        if left:
            self._pending[url] = left
        else:
            del self._pending[url]
