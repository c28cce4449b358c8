"""engine_pool/monitor.py: what the background watch reports, from what it reads."""

from __future__ import annotations

from engine_pool.monitor import EngineRestarted, restarted


def test_a_new_process_start_time_is_a_restart_and_nothing_else_is() -> None:
    assert restarted("c", "http://a", 100.0, 250.0) == EngineRestarted(
        "c", "http://a", 100.0, 250.0
    )
    # The first read, an engine not exporting it, and the same start again: no restart.
    assert restarted("c", "http://a", None, 100.0) is None
    assert restarted("c", "http://a", 100.0, None) is None
    assert restarted("c", "http://a", 100.0, 100.0) is None
