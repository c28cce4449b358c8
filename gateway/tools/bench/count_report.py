"""The report of ``shapegate bench count`` (count.py): its targets, its table and its README
section, from the result it writes to ``count.json``."""

from __future__ import annotations

from typing import Any

from gateway.tools.bench.harness import machine_line, with_targets


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    by = {r["size"]: r for r in result["requests"]}
    pss = result["pss_mb"]
    rows = [
        (
            "3k decided by the bound (no tokenizer), p50 ms",
            by["3k"]["decide"]["p50_ms"],
            0.2,
            by["3k"]["decide_methods"] == ["bound"],
        ),
        ("32k decided exactly, p50 ms", by["32k"]["decide"]["p50_ms"], 3.0, True),
        ("300k decided exactly, p50 ms", by["300k"]["decide"]["p50_ms"], 15.0, True),
        (
            "PSS with the demo tokenizers loaded, MB",
            pss["after_load"],
            300.0,
            True,
        ),
    ]
    out = [
        {"target": name, "value": value, "limit": limit, "met": bool(ok and value < limit)}
        for name, value, limit, ok in rows
    ]
    speedup = by["32k"].get("speedup_decide_vs_hf", 0.0)
    out.append(
        {
            "target": "32k: times faster than HF tokenizers (decide vs HF encode)",
            "value": speedup,
            "limit": 30.0,
            "met": speedup >= 30.0,
        }
    )
    return out


def table(result: dict[str, Any]) -> str:
    lines = [
        f"shapegate bench count: {result['tokenizer']} on cpus {result['cpu_affinity']}"
        f"{' (SMOKE: sizes x0.1, figures not meaningful)' if result['smoke'] else ''}",
        machine_line(result["machine"]),
        f"exact_above={result['exact_above']}  load={result['load_s']}s  "
        f"pss after load={result['pss_mb']['after_load']} MB, after counting "
        f"{result['pss_mb']['after_counting_less_bench_texts']} MB"
        + (
            " (gigatoken's pre-token cache grows with every new word it sees, in a child "
            "replaced past its bound)"
            if result["exact_backend"] == "gigatoken"
            else ""
        ),
        "",
        f"{'size':>5} {'tokens':>8} {'decide p50':>11} {'how':>6} {'exact p50':>10} "
        f"{'cache p50':>10} {'HF p50':>9} {'x HF':>7} {'jinja decide':>12}",
    ]
    for r in result["requests"]:
        lines.append(
            f"{r['size']:>5} {r['tokens']:>8} {r['decide']['p50_ms']:>9.3f}ms "
            f"{','.join(r['decide_methods']):>6} {r['exact']['p50_ms']:>8.3f}ms "
            f"{r['cache']['p50_ms']:>8.3f}ms {r.get('hf', {}).get('p50_ms', float('nan')):>7.1f}ms "
            f"{r.get('speedup_decide_vs_hf', float('nan')):>7.1f} "
            f"{r.get('decide_own_template', {}).get('p50_ms', float('nan')):>10.3f}ms"
        )
    lines.append("")
    lines += _by_backend_lines(result)
    lines.append("")
    plain = result["plain_install"]
    stalls = [(result["exact_backend"], c, s) for c, s in result["loop_stall"].items()]
    stalls += [(plain["backend"], c, s) for c, s in plain.get("loop_stall", {}).items()]
    for backend, cores, stall in stalls:
        lines.append(
            f"event loop, {backend}, {cores}, {stall['prompt_chars']}-char count: via count() "
            f"{stall['worker_thread']['count_ms']} ms, 1 ms ticker late <= "
            f"{stall['worker_thread']['max_tick_late_ms']} ms; inline "
            f"{stall['inline']['count_ms']} ms, late <= {stall['inline']['max_tick_late_ms']} ms"
        )
    lines += [
        "",
        f"{'vocabulary':>22} {'kind':>6} {'chars/tok':>9} {'bytes/tok':>9} {'chars/4 vs real':>15}",
    ]
    for c in result["calibration"]:
        lines.append(
            f"{c['vocabulary']:>22} {c['kind']:>6} {c['chars_per_token']:>9} "
            f"{c['bytes_per_token']:>9} {c['chars_over_4_vs_real']:>15}"
        )
    return with_targets(lines, result["targets"])


def _by_backend_lines(result: dict[str, Any]) -> list[str]:
    """Exact counts of the same prompts by backend, p50 and its ratio to HF's in this run."""
    plain = result["plain_install"]
    lines = [
        "exact count of the same prompts, p50 (x HF: HF p50 over it, same run); tiktoken is the "
        "plain install (no [gigatoken] extra)"
        + (f", absent: {plain['absent']}" if plain["backend"] is None else ""),
        f"{'size':>5} {'tokens':>8} {'gigatoken':>18} {'tiktoken':>18} {'HF':>10}",
    ]
    for r in result["requests"]:
        cells = []
        for backend in ("gigatoken", "tiktoken"):
            figures = r["exact_by_backend"][backend]
            cells.append(
                "absent"
                if figures is None
                else f"{figures['p50_ms']:.3f}ms x{figures['x_hf']:<5.1f}"
            )
        lines.append(
            f"{r['size']:>5} {r['tokens']:>8} {cells[0]:>18} {cells[1]:>18} "
            f"{r['hf']['p50_ms']:>8.3f}ms"
        )
    if plain["backend"] is not None:
        lines.append(
            f"plain install counter ({plain['tokenizer']}): loaded in {plain['load_s']} s, "
            f"+{plain['pss_mb_added']} MB PSS"
        )
    return lines


def readme_lines(
    r: dict[str, Any], machine_text: str, smoke: list[str], verdicts: list[str]
) -> list[str]:
    """The README's section (``shapegate bench readme``)."""
    lines = [
        "### Token counting (`shapegate bench count`)",
        "",
        f"Machine: {machine_text}; one core. Tokenizer {r['tokenizer']}; the baseline is "
        "Hugging Face `tokenizers` on the same rendered prompts in the same run (counts must "
        "agree).",
        *smoke,
        "",
        "| size | tokens | decide p50 ms (how) | exact p50 ms | cached p50 ms | HF p50 ms "
        "| x faster than HF |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for q in r["requests"]:
        hf = q.get("hf", {}).get("p50_ms")
        lines.append(
            f"| {q['size']} | {q['tokens']} | {q['decide']['p50_ms']:.3f} "
            f"({', '.join(q['decide_methods'])}) | {q['exact']['p50_ms']:.3f} "
            f"| {q['cache']['p50_ms']:.3f} | {'-' if hf is None else f'{hf:.1f}'} "
            f"| {q.get('speedup_decide_vs_hf', '-')} |"
        )
    lines += _by_backend_readme(r)
    lines += [
        "",
        f"PSS with the tokenizers loaded (the process, the tokenizer template and its counting "
        f"child; a page they share counted once): {r['pss_mb']['after_load']} MB.",
        "",
        *verdicts,
        "",
    ]
    return lines


def _by_backend_readme(r: dict[str, Any]) -> list[str]:
    """What a plain install (tiktoken, no ``[gigatoken]`` extra) gives up, from the same run."""
    plain = r.get("plain_install")
    if plain is None or "exact_by_backend" not in r["requests"][0]:
        return []  # count.json predates the plain install's figures
    if plain["backend"] is None:
        return ["", f"The plain install's tiktoken path: absent ({plain['absent']})."]

    def cell(figures: dict[str, Any] | None) -> str:
        return "absent" if figures is None else f"{figures['p50_ms']:.3f} (x{figures['x_hf']})"

    lines = [
        "",
        "Exact count of the same prompts by backend, p50 ms (x: HF p50 over it, same run). "
        "`gigatoken` needs the `[gigatoken]` extra; a plain `pip install shapegate` counts with "
        "`tiktoken` on ranks rewritten from the tokenizer.json (counts equal HF's).",
        "",
        "| size | tokens | gigatoken | tiktoken (plain install) | HF |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for q in r["requests"]:
        by = q["exact_by_backend"]
        lines.append(
            f"| {q['size']} | {q['tokens']} | {cell(by['gigatoken'])} | {cell(by['tiktoken'])} "
            f"| {q['hf']['p50_ms']:.1f} |"
        )
    for cores, stall in plain["loop_stall"].items():
        lines += [
            "",
            f"Plain install, {cores.replace('_', ' ')}, a {stall['prompt_chars']}-character count "
            f"through `count()`: {stall['worker_thread']['count_ms']} ms, a 1 ms ticker late by "
            f"at most {stall['worker_thread']['max_tick_late_ms']} ms (inline: "
            f"{stall['inline']['max_tick_late_ms']} ms).",
        ]
    return lines
