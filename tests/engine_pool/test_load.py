"""engine_pool/load.py: the load series read straight out of a full-sized /metrics page."""

from __future__ import annotations

import math
import random

from engine_pool.load import NAMES, parse_load


def _whole_page_sums(text: str) -> dict[str, float]:
    """The reference: split and parse every line (what the scraper did before); a process
    start time is the highest, not a sum."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        if brace >= 0:
            name, value_part = line[:brace], line[line.rfind("}") + 1 :].split()
        else:
            name, *value_part = line.split()
        try:
            value = float(value_part[0]) if value_part else math.nan
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        if name == "process_start_time_seconds":
            sums[name] = max(sums.get(name, value), value)
        else:
            sums[name] = sums.get(name, 0.0) + value
    return sums


def _page(rng: random.Random, kind: str) -> str:
    wanted = [n for series in NAMES[kind].values() for n in series]  # type: ignore[index]
    lines = []
    for h in range(rng.randint(0, 30)):  # histograms: the bulk of a real page
        lines.append(f"# HELP {kind}:hist_{h} latency")
        lines += [f'{kind}:hist_{h}_bucket{{le="{b}"}} {b * 3}' for b in range(20)]
    for _ in range(rng.randint(0, 12)):
        name = rng.choice(wanted)
        form = rng.randrange(5)
        if form == 0:
            lines.append(f'{name}{{engine="{rng.randrange(3)}",model_name="m"}} {rng.random():.4f}')
        elif form == 1:
            lines.append(f"{name} {rng.randint(0, 100)}")
        elif form == 2:
            lines.append(f"{name}_lookalike {rng.randint(0, 100)}")  # a longer name: not it
        elif form == 3:
            lines.append(f"# HELP {name} a comment naming it")
        else:
            lines.append(f'{name}{{engine="0"}} NaN')
    rng.shuffle(lines)
    return rng.choice(["\n", "\r\n"]).join(lines) + rng.choice(["", "\n"])


def test_the_load_read_from_the_wanted_lines_equals_a_parse_of_the_whole_page() -> None:
    rng = random.Random(21)
    for _ in range(400):
        kind = rng.choice(["vllm", "sglang"])
        text = _page(rng, kind)
        sums = _whole_page_sums(text)
        names = NAMES[kind]  # type: ignore[index]
        expected = tuple(
            next((sums[n] for n in names[what] if n in sums), None)
            for what in ("running", "waiting", "kv_usage")
        )
        tokens = [sums[n] for n in names["tokens"] if n in sums]
        load = parse_load(kind, text)  # type: ignore[arg-type]
        assert (load.running, load.waiting, load.kv_usage) == expected, text
        assert load.tokens_total == (sum(tokens) if tokens else None), text
        assert load.started_s == sums.get("process_start_time_seconds"), text


# As a vLLM 0.32 API server's /metrics has it (prometheus_client's process collector).
VLLM_PAGE = (
    ("# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n")
    + """# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.76489101234e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
vllm:num_requests_running{engine="0",model_name="qwen3.6"} 2.0
vllm:num_requests_waiting{engine="0",model_name="qwen3.6"} 1.0
"""
)


def test_the_engines_process_start_time_is_read_and_never_summed() -> None:
    load = parse_load("vllm", VLLM_PAGE)
    assert load.started_s == 1_764_891_012.34 and load.running == 2.0
    assert parse_load("sglang", "process_start_time_seconds 12.5\n").started_s == 12.5
    # Two processes' lines (a multi-process page): the newest start, not 2x a date.
    two = "process_start_time_seconds 100.0\nprocess_start_time_seconds 250.0\n"
    assert parse_load("vllm", two).started_s == 250.0
    assert parse_load("vllm", "vllm:num_requests_running 1\n").started_s is None
