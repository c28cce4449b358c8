"""``shapegate bench SUITE``: benchmarks that print a table and write ``<out>/<suite>.json``.

Each suite is a module exposing ``register(suites)``, which adds its parser to the ``bench``
sub-subparsers and sets ``func`` (namespace -> exit code). Adding a suite is one line in
``SUITES``. Suites are imported only when ``shapegate bench`` is parsed... by ``shapegate``'s own
``build_parser``, so keep their top-level imports light (load tokenizers inside ``func``).
"""

from __future__ import annotations

import argparse
import importlib

SUITES: tuple[str, ...] = (
    "gateway.tools.bench.count",
    "gateway.tools.bench.overhead",
    "gateway.tools.bench.lanes",
    "gateway.tools.bench.memory",
    "gateway.tools.bench.encoder",
    "gateway.tools.bench.every",  # shapegate bench all
    "gateway.tools.bench.readme",  # shapegate bench readme
    "gateway.tools.bench.soak",  # shapegate bench soak
    "gateway.tools.bench.tracing",  # shapegate bench tracing
    "gateway.tools.bench.fidelity",  # shapegate bench fidelity
    "gateway.tools.bench.borrow",  # shapegate bench borrow
    "gateway.tools.bench.workers",  # shapegate bench workers
    "gateway.tools.bench.monsters",  # shapegate bench monsters
    "gateway.tools.bench.shadow",  # shapegate bench shadow
    "gateway.tools.bench.prefix",  # shapegate bench prefix
    "gateway.tools.bench.prefix_soak",  # shapegate bench prefix-soak
    # one module path a line
)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark suite and write its JSON")
    suites = parser.add_subparsers(
        dest="suite", required=True, metavar="SUITE", help="the benchmark suite to run"
    )
    for path in SUITES:
        importlib.import_module(path).register(suites)
