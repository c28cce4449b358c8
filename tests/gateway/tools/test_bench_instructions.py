"""``bench shadow --instructions`` (gateway/tools/bench/instructions.py): the parts that need no
valgrind run: the dump's total as callgrind writes it, and the quiet policy (no probe or scrape
inside a counted window)."""

from __future__ import annotations

import sys

import pytest

import gateway.request.shadow_live as shadow_live
import gateway.tools.cli as cli
from gateway.settings import parse_settings
from gateway.tools.bench.harness import gateway_policy
from gateway.tools.bench.instructions import _SERVE_NO_MEMO, _TOTALS, QUIET_S, _quiet

DUMP = b"""# callgrind format
version: 1
creator: callgrind-3.19.0
cmd:  python -m gateway.tools.cli serve
part: 3

events: Ir
fn=(1) main
5 12
summary: 123456789
totals: 123456789
"""


def test_a_dumps_total_is_its_summary_line() -> None:
    found = _TOTALS.search(DUMP)
    assert found is not None and int(found.group(1)) == 123456789
    assert _TOTALS.search(b"events: Ir\nfn=(1) x\n5 12\n") is None


def test_the_counted_gateway_probes_and_scrapes_an_hour_apart() -> None:
    policy = _quiet(gateway_policy(9000, 9001))
    settings = parse_settings(policy, environ={})
    for lane in settings.lanes:
        assert lane.health.interval_s == lane.health.scrape_interval_s == QUIET_S


def test_the_gateway_counted_without_memo_is_serve_with_the_memo_keeping_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--memo-miss`` starts ``serve`` with ``shadow_live.MEMO_MAX = 0`` set before the app is
    made (the same arguments otherwise)."""
    seen: list[tuple[list[str], int]] = []

    def main(argv: list[str]) -> int:
        seen.append((list(argv), shadow_live.MEMO_MAX))
        return 0

    monkeypatch.setattr(cli, "main", main)
    monkeypatch.setattr(shadow_live, "MEMO_MAX", shadow_live.MEMO_MAX)  # restored after
    monkeypatch.setattr(sys, "argv", ["-c", "--config", "gateway.yaml"])
    with pytest.raises(SystemExit) as stopped:
        exec(_SERVE_NO_MEMO, {})  # the command line's own code, as python -c runs it
    assert stopped.value.code == 0
    assert seen == [(["serve", "--config", "gateway.yaml"], 0)]
