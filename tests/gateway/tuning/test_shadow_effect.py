"""A shadow's predicted effect (gateway/tuning/shadow_effect.py): the live window replayed
under both policies, with the calibration it used."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.observe.trace import TraceRecord, synthesize
from gateway.settings import parse_settings
from gateway.tuning.fleet_model import LiveCosts
from gateway.tuning.shadow_effect import predict_effect
from tests.conftest import lanes_config


def policy(threshold: int, profiles: bool = True) -> Any:
    config = lanes_config(["http://f1", "http://f2"], ["http://h1"], threshold=threshold)
    if profiles:
        config["clusters"][0]["sim_profile"] = "h100-fast"
        config["clusters"][1]["sim_profile"] = "h100-heavy"
    return parse_settings(config, environ={})


def window() -> list[TraceRecord]:
    """Ten minutes of production-burst shapes under 32,768 tokens, on wall seconds."""
    shapes = [r for r in synthesize("production-burst", 1) if r.prompt_tokens < 32768]
    return [r for r in shapes if r.t < 600]


def test_both_policies_are_replayed_and_the_calibration_is_stated() -> None:
    trace = window()
    moved = sum(1 for r in trace if r.prompt_tokens >= 8192)
    assert moved > 0
    effect = predict_effect(policy(32768), policy(8192), trace, LiveCosts(time_scale=0.5))
    assert effect["requests"] == len(trace)
    lanes = {
        side: {k: v["requests"] for k, v in effect[side]["small_ttft_by_lane"].items()}
        for side in ("active", "shadow")
    }
    assert lanes["active"] == {"fast": len(trace)}
    assert lanes["shadow"] == {"fast": len(trace) - moved, "heavy": moved}
    assert effect["shadow"]["peak_slots"]["heavy"]["peak"] > 0
    assert effect["active"]["peak_slots"]["heavy"]["peak"] == 0
    calibration = effect["calibration"]
    defaults = LiveCosts()
    assert calibration["time_scale"] == 0.5
    assert (calibration["gateway_ms"], calibration["relay_ms"]) == (
        defaults.gateway_s * 1000,
        defaults.relay_s * 1000,
    )


def test_a_candidate_without_profiles_takes_the_running_clusters_and_none_at_all_is_an_error() -> (
    None
):
    trace = window()[:20]
    found = predict_effect(policy(32768), policy(8192, profiles=False), trace, LiveCosts())
    assert found["shadow"]["small_ttft"]["requests"] == 20
    with pytest.raises(ValueError, match="sim_profile"):
        predict_effect(policy(32768, False), policy(8192, False), trace, LiveCosts())
