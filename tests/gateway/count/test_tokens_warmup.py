"""Warm-up that rehearses arrivals: the first monster after boot is counted as fast as the tenth.

Measured before the change: the first 300k-token prompt after boot took 0.2-1.6 s to count
against 15-30 ms warm; the boot warm-up encoded only a ~20 KB text."""

from __future__ import annotations

import os
import random
import signal
import statistics
import time
from pathlib import Path

import pytest
import yaml
from structlog.testing import capture_logs

from gateway.count.tokenizers import warmup
from gateway.count.tokenizers.worker import ChildEncoder
from gateway.count.tokens import TokenCounter
from gateway.protocols.openai import ChatPrompt
from gateway.settings import parse_settings
from gateway.tools.cli import main
from tests.conftest import lanes_config

# Slack for one scheduling hiccup on a shared core, far below the cold path's 0.2-1.6 s.
JITTER_S = 0.010
WORDS = ["route", "token", "lane", "slot", "engine", "queue", "batch", "model", "cache", "prefill"]


def _policy(**counting: int) -> dict[str, object]:
    config = lanes_config(["http://x"], ["http://y"], counting=counting)
    config["lanes"][1]["max_prompt_tokens"] = 400_000  # the heavy lane admits up to 400k
    return config


def _monster(rng: random.Random, index: int) -> ChatPrompt:
    text = f"r{index}" + "".join(" " + w for w in rng.choices(WORDS, k=300_000))
    return ChatPrompt(messages=({"role": "user", "content": text},))


async def _first_and_warm(counter: TokenCounter) -> tuple[float, float]:
    """Seconds to count the first 300k-token prompt, and the p50 of the next eight (all
    different texts: no cache helps), through the request path (``count``)."""
    rng = random.Random(7)
    prompts = [_monster(rng, i) for i in range(9)]
    seconds = []
    for prompt in prompts:
        started = time.perf_counter()
        found = await counter.count("qwen3.6", prompt, exact_above=0)
        seconds.append(time.perf_counter() - started)
        assert found.method == "exact" and found.tokens > 300_000
    return seconds[0], statistics.median(seconds[1:])


async def test_the_first_300k_token_prompt_after_boot_counts_within_2x_of_the_warm_p50() -> None:
    with capture_logs() as logs:
        counter = TokenCounter.from_settings(parse_settings(_policy(), environ={}))
    warmed = [e for e in logs if e["event"] == "tokenizer.warmed"]
    # As large as the lanes admit, through the request path, and its time logged.
    assert len(warmed) == 1 and 399_000 <= warmed[0]["tokens"] <= 401_000
    assert warmed[0]["warm_ms"] > 0
    child = [e for e in logs if e["event"] == "tokenizer.child_warmed"]
    assert child and child[0]["warm_chars"] == int(399_999 * warmup.CHARS_PER_TOKEN)
    first, warm = await _first_and_warm(counter)
    # Within 2x the warm p50, or within 10 ms of it where that p50 is a few ms (AMD EPYC: 6 ms
    # warm, a first of 14 ms once in CI): one scheduling hiccup is not a cold path, which cost
    # 0.2-1.6 s (module docstring).
    bound = max(2 * warm, warm + JITTER_S)
    assert first <= bound, f"first {first * 1000:.0f} ms, warm p50 {warm * 1000:.0f} ms"


async def test_without_the_large_warm_up_the_first_monster_is_slow() -> None:
    """``counting.warmup_tokens: 0`` keeps the small warm-up only: the cost comes back."""
    with capture_logs() as logs:
        counter = TokenCounter.from_settings(parse_settings(_policy(warmup_tokens=0), environ={}))
    assert not [e for e in logs if e["event"] == "tokenizer.warmed"]
    first, warm = await _first_and_warm(counter)
    assert first > 2 * warm, f"first {first * 1000:.0f} ms, warm p50 {warm * 1000:.0f} ms"


def test_a_replaced_child_is_warmed_as_large_before_it_answers() -> None:
    counter = TokenCounter.from_settings(parse_settings(_policy(warmup_tokens=200_000), environ={}))
    encoder = counter._model("qwen3.6").vocab.encoder
    assert isinstance(encoder, ChildEncoder)
    assert encoder.warm_chars == int(200_000 * warmup.CHARS_PER_TOKEN)
    victim = encoder.pid
    os.kill(victim, signal.SIGKILL)
    with capture_logs() as logs:
        assert encoder.count_many(["after the crash"]) == [3]
    assert encoder.pid != victim
    warmed = [e for e in logs if e["event"] == "tokenizer.child_warmed"]
    assert warmed and warmed[0]["pid"] == encoder.pid
    # A fork of the template, which warmed that much once; then the same size through its pipe.
    assert warmed[0]["template_pid"] == encoder.template_pid
    assert warmed[0]["warm_chars"] == encoder.warm_chars and warmed[0]["pipe_ms"] > 0


def test_the_warm_up_size_follows_the_lanes_the_model_and_the_setting() -> None:
    settings = parse_settings(_policy(), environ={})
    assert warmup.warm_tokens(settings, None) == 399_999
    assert warmup.warm_tokens(settings, 131_072) == 131_072
    huge = _policy()
    huge["lanes"][1]["max_prompt_tokens"] = 10**9  # type: ignore[index]
    assert warmup.warm_tokens(parse_settings(huge, environ={}), None) == warmup.MAX_WARM_TOKENS
    assert warmup.warm_tokens(parse_settings(_policy(warmup_tokens=5000), environ={}), None) == 5000


def test_check_config_accepts_the_warm_up_size_and_refuses_a_negative_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for value, code in ((50_000, 0), (-1, 2)):
        path = tmp_path / "policy.yaml"
        path.write_text(yaml.safe_dump(_policy(warmup_tokens=value)))
        assert main(["check-config", str(path)]) == code
    assert "warmup_tokens" in capsys.readouterr().err
