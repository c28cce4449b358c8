"""``shapegate bench all``: every suite, one after another, into one folder; then the README.

Runs ``overhead``, ``count``, ``lanes``, ``borrow``, ``memory``, ``encoder`` and ``monsters``
(each with its own defaults, or its ``--smoke`` version), as ``shapegate bench SUITE --out OUT``
would, and stops at the first that fails. With ``--readme FILE`` it then regenerates that file's
performance section from the JSON just written (``shapegate bench readme``).
"""

from __future__ import annotations

import argparse
import time

ORDER = ("overhead", "count", "lanes", "borrow", "memory", "encoder", "monsters")


def register(suites: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = suites.add_parser("all", help="every suite, then optionally the README section")
    parser.add_argument("--out", default="bench-results", help="folder for every suite's files")
    parser.add_argument("--smoke", action="store_true", help="each suite's smoke version")
    parser.add_argument("--readme", default=None, help="regenerate this README's section")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gateway.tools import bench

    # The bench commands alone, as ``shapegate`` parses them (gateway/tools/cli.py registers the
    # same).
    parser = argparse.ArgumentParser(prog="shapegate")
    bench.register(parser.add_subparsers(dest="command", required=True))
    took = {}
    for suite in ORDER:
        argv = ["bench", suite, "--out", args.out, *(["--smoke"] if args.smoke else [])]
        print(f"\n=== shapegate {' '.join(argv)}", flush=True)
        started = time.perf_counter()
        suite_args = parser.parse_args(argv)
        code: int = suite_args.func(suite_args)
        took[suite] = time.perf_counter() - started
        if code != 0:
            print(f"shapegate bench all: {suite} failed with exit code {code}")
            return code
    print("\n" + ", ".join(f"{suite} {seconds:.0f}s" for suite, seconds in took.items()))
    if args.readme:
        readme_args = parser.parse_args(["bench", "readme", "--out", args.out, args.readme])
        readme_code: int = readme_args.func(readme_args)
        return readme_code
    return 0
