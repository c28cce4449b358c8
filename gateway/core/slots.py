"""Slot keys and limits: the names admission, the stores and the admin view share.

A request holds a slot in its lane (``lane_key``) and one on its endpoint (``endpoint_key``); a
borrower also holds ``borrow_key`` on the lender's endpoint, and a lender's waiter may reserve it
(``reserve_key``). ``Limit`` is one candidate key with its limit and the keys that must be empty
for it to be taken (gateway/slots/store.py says how a store takes them).
"""

from __future__ import annotations

from typing import NamedTuple


class Limit(NamedTuple):
    """A named tuple, not a frozen dataclass: a request builds two (its lane's and its
    endpoint's), and a frozen dataclass's ``__init__`` sets each field through
    ``object.__setattr__``."""

    key: str
    limit: int
    # Keys that must hold no other token's slot for this one to be taken (checked in the same
    # atomic step): a lender's own requests and its borrowers exclude each other this way.
    guards: tuple[str, ...] = ()


def lane_key(lane: str) -> str:
    return f"lane:{lane}"


def endpoint_key(cluster: str, url: str) -> str:
    return f"ep:{cluster}:{url}"


def borrow_key(cluster: str, url: str) -> str:
    """Another lane's requests borrowing the endpoint (gateway/request/borrowing.py)."""
    return f"borrow:{cluster}:{url}"


def reserve_key(cluster: str, url: str) -> str:
    """The lender's waiter that reserved the endpoint for its borrowers to drain."""
    return f"reserve:{cluster}:{url}"
