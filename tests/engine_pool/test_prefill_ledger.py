"""The prefill ledger: what each endpoint still has to prefill for the requests sent to it."""

from __future__ import annotations

from engine_pool.prefill_ledger import PrefillLedger


def test_pending_adds_per_endpoint_and_forgets_a_request_once_done() -> None:
    ledger = PrefillLedger()
    ledger.add("r1", "http://a", 300_000)
    ledger.add("r2", "http://a", 400)
    ledger.add("r3", "http://b", 0)
    assert ledger.pending == {"http://a": 300_400}
    ledger.done("r1")
    ledger.done("r1")  # idempotent
    ledger.done("unknown")
    assert ledger.pending == {"http://a": 400}
    ledger.done("r2")
    ledger.done("r3")
    assert ledger.pending == {} and len(ledger) == 0


def test_a_request_added_again_moves_its_tokens() -> None:
    """Failover and migration send the same request to another endpoint: counted once."""
    ledger = PrefillLedger()
    ledger.add("r1", "http://a", 5_000)
    ledger.add("r1", "http://b", 7_000)
    assert ledger.pending == {"http://b": 7_000} and len(ledger) == 1
    ledger.add("r2", "http://a", -5)  # a belief above the prompt: nothing pending
    assert ledger.pending == {"http://b": 7_000}
