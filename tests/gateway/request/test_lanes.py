from __future__ import annotations

from gateway.request.lanes import choose_lane, exact_count_above, lane_tokens, no_lane_message
from gateway.settings import parse_settings
from tests.conftest import lanes_config


def policy(**lane_overrides: object) -> object:
    config = lanes_config(["http://a"], ["http://b"], threshold=32768)
    config["clusters"].append({"name": "spare", "endpoints": ["http://c"]})
    config["lanes"][1]["emergency_clusters"] = ["spare"]
    config["lanes"][1].update(lane_overrides)
    return parse_settings(config, environ={})


def test_the_threshold_splits_lanes_in_tokens() -> None:
    lanes = policy().lanes  # type: ignore[attr-defined]
    assert choose_lane(32767, lanes, {}).lane_name == "fast"
    assert choose_lane(32768, lanes, {}).lane_name == "heavy"
    assert choose_lane(0, lanes, {}).reason == "in_range"
    assert choose_lane(1_000_000, lanes, {}).reason == "no_lane"


def test_emergency_clusters_only_when_every_primary_is_down() -> None:
    lanes = policy().lanes  # type: ignore[attr-defined]
    up = choose_lane(50_000, lanes, {"heavy": True, "spare": True})
    assert up.clusters == ("heavy",) and up.reason == "in_range"
    down = choose_lane(50_000, lanes, {"heavy": False, "spare": True})
    assert down.clusters == ("spare",) and down.reason == "primary_unhealthy"
    none = choose_lane(50_000, lanes, {"heavy": False, "spare": False})
    assert none.clusters == () and none.reason == "no_healthy_cluster"


def test_the_bound_decides_below_the_first_ceiling() -> None:
    assert exact_count_above(policy().lanes) == 32768  # type: ignore[attr-defined]


def test_the_no_lane_message_is_true_above_and_inside_a_hole() -> None:
    fast, heavy = policy().lanes  # type: ignore[attr-defined]
    assert no_lane_message(1_000_000, [fast, heavy]) == (
        "prompt of 1000000 tokens is above every lane's range (largest 999999)"
    )
    # Validation refuses a hole between lanes; a lane list built around it still says why.
    holed = [fast, heavy.model_copy(update={"min_prompt_tokens": 40_000})]
    assert no_lane_message(35_000, holed) == (
        "no lane takes a prompt of 35000 tokens (lanes take 0-32767, 40000-999999)"
    )


def test_a_batch_is_laned_by_its_total_but_refused_only_for_a_prompt_too_long() -> None:
    """Prefill work is the sum (every prompt of a batch is admitted at once); context fit is per
    prompt: a batch of prompts that each fit goes to the top lane whatever its total."""
    lanes = policy().lanes  # type: ignore[attr-defined]
    # Four prompts of 10,000 tokens: each would be fast, together they are 40,000 of prefill.
    assert choose_lane(lane_tokens(40_000, 10_000, lanes), lanes, {}).lane_name == "heavy"
    # A single prompt: its count is its figure.
    assert lane_tokens(20_000, 20_000, lanes) == 20_000
    # Four prompts of 300,000: the total is past every lane, each fits the heavy lane.
    assert lane_tokens(1_200_000, 300_000, lanes) == 999_999
    assert choose_lane(lane_tokens(1_200_000, 300_000, lanes), lanes, {}).lane_name == "heavy"
    # One prompt past every lane: no lane, whatever the others.
    assert choose_lane(lane_tokens(1_100_000, 1_000_000, lanes), lanes, {}).reason == "no_lane"
