"""``shapegate bench prefix --smoke``: the chain against the other routers, and the lookup cost."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.tools.cli import main
from gateway.tuning.fleet_sim import ROUTERS

ROOT = Path(__file__).resolve().parents[3]


def test_bench_prefix_smoke_plays_every_router_and_times_the_lookup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    assert main(["bench", "prefix", "--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "prefix.json").read_text())
    (seed,) = result["per_seed"]
    rows = seed["routers"]
    assert set(rows) == set(ROUTERS)
    assert all(r["rejected"] == 0 and r["monsters"] > 0 for r in rows.values())
    # Routing by prefix finds more cached and answers small requests sooner than least-loaded.
    assert rows["chain"]["hit_rate"] > rows["least-loaded"]["hit_rate"]
    assert rows["chain"]["small_ttft_p90_s"] < rows["least-loaded"]["small_ttft_p90_s"]
    assert result["lookup_200k_tokens"]["block_16_ms"] > 0
    ids = result["prompt_ids"]
    assert 150_000 < ids["tokens"] < 250_000
    assert ids["cached_pieces_ms"] > 0 and ids["encode_whole_ms"] > 0
    assert len(result["targets"]) == 5
