"""engine_pool/load.py: the load series read straight out of a full-sized /metrics page."""

from __future__ import annotations

import math
import random

from engine_pool.load import NAMES, parse_load


def _whole_page_sums(text: str) -> dict[str, float]:
    """The reference: split and parse every line (what the scraper did before)."""
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
        if math.isfinite(value):
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
