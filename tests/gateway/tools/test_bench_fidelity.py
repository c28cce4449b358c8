"""``shapegate bench fidelity --smoke``: the demo played live at scale 0.05 against the what-if."""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path

import httpx
import pytest

from gateway.tools.bench import fidelity
from gateway.tools.cli import main

ROOT = Path(__file__).resolve().parents[3]


def test_bench_fidelity_smoke_plays_the_demo_and_writes_ratios(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    assert main(["bench", "fidelity", "--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "fidelity.json").read_text())
    assert (tmp_path / "fidelity.png").stat().st_size > 5_000
    (row,) = result["scales"]
    assert row["time_scale"] == 0.05 and result["requests"] == row["requests"] > 0
    assert row["not_served"] == 0 and row["count_mismatches"] == 0
    # Measured from the engines' own records: the live path costs milliseconds.
    assert row["measured_costs"]["requests"] == result["requests"]
    assert row["measured_costs"]["pre_engine_ms_p50"] > 0
    for model in ("engine_only", "predicted", "calibrated"):
        worst = row[model]["worst_ratio"]
        assert math.isfinite(worst) and worst >= 1
        assert set(row[model]["ratios"]["small"]) >= {"ttft_p50", "e2e_p99"}
    # Modelling the live path can only add time: the baseline predicts less than the model.
    assert (
        row["engine_only"]["figures"]["small_requests"]["ttft_p50"]
        < row["predicted"]["figures"]["small_requests"]["ttft_p50"]
    )
    assert [t["limit"] for t in result["targets"]] == [1.1, 1.1]


def test_a_demo_whose_port_was_taken_before_it_bound_starts_again_on_new_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The race the benches meet on a busy machine: a port free when chosen, taken before the
    demo binds it. The first ports offered here are held by a listening socket."""
    monkeypatch.chdir(Path(__file__).resolve().parents[3])
    real_ports = fidelity._ports
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        offered = iter([(holder.getsockname()[1], real_ports()[1])])
        monkeypatch.setattr(fidelity, "_ports", lambda: next(offered, None) or real_ports())
        demo, port, _ = fidelity.start_demo(1.0, tmp_path)
        try:
            assert port != holder.getsockname()[1]
            assert httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200
        finally:
            demo.stop(30)
    assert "already in use" in (tmp_path / "demo-1.log").read_text()
    assert "a port was taken before it bound (attempt 1)" in capsys.readouterr().out


def test_a_demo_that_exits_for_another_reason_is_not_started_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(Path(__file__).resolve().parents[3])  # engines refuse the time scale
    with pytest.raises(RuntimeError, match="demo exited"):
        fidelity.start_demo(-1.0, tmp_path)
    assert not (tmp_path / "demo-2.log").exists()
