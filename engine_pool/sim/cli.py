"""``shapegate sim``: run one simulated vLLM engine in the foreground until SIGINT or SIGTERM.

    shapegate sim --port 9101 --profile h100-fast [--time-scale 0.01] [--host 127.0.0.1]
                  [--model NAME] [--faults 'dead' | 'error_500_rate=0.2,drop_after_chunks=3'
                  | '{"hang": true}'] [--seed N] [--enable-force-include-usage]

Exit codes: 0 after a signal, 2 for a bad profile, fault or argument. Ready when it logs
``sim.started`` (and ``GET /health`` answers). Profiles are names under ``configs/engines/`` or
YAML paths; ``--model`` replaces the served model name (the tokenizer stays the profile's).

``register(subparsers, counter_for, configure_logging)`` takes what the sim cannot own (it
never imports the gateway): how to build a profile's ``PromptCounter`` and how to set up the
process's logging. ``gateway/tools/sim_support.py`` registers it with the gateway's.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine_pool.sim.counting import PromptCounter
from engine_pool.sim.profile import EngineProfile, ProfileError, available_profiles, load_profile

if TYPE_CHECKING:
    from engine_pool.sim.faults import FaultSpec

CounterFor = Callable[[EngineProfile], PromptCounter]


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    counter_for: CounterFor,
    configure_logging: Callable[[str], None],
) -> None:
    parser = subparsers.add_parser("sim", help="run one simulated vLLM engine")
    parser.add_argument("--port", type=int, required=True, help="port to listen on")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument(
        "--profile",
        default="h100-shared",
        help=f"engine profile name ({', '.join(available_profiles())}) or YAML path",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="wall seconds per simulated second (0.01 = 100x faster)",
    )
    parser.add_argument("--model", default=None, help="served model name (default: profile's)")
    parser.add_argument(
        "--faults",
        default=None,
        help="faults to start with, e.g. 'dead', 'error_500_rate=0.2,drop_after_chunks=3' or "
        "JSON (README: Simulator faults; change them live with POST /sim/faults)",
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="seed for fault rates (default: random)"
    )
    parser.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="vLLM's flag of that name: every streamed chunk carries usage (default: the "
        "profile's enable_force_include_usage)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="least severe log event printed",
    )
    parser.set_defaults(
        func=functools.partial(run, counter_for=counter_for, configure_logging=configure_logging)
    )


async def _serve(
    profile: EngineProfile, args: argparse.Namespace, faults: FaultSpec, counter: PromptCounter
) -> int:
    from engine_pool.sim.server import run_sim

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with run_sim(
        profile,
        counter=counter,
        time_scale=args.time_scale,
        faults=faults,
        host=args.host,
        port=args.port,
        seed=args.seed,
    ):
        await stop.wait()
    return 0


def run(
    args: argparse.Namespace, counter_for: CounterFor, configure_logging: Callable[[str], None]
) -> int:
    # Imported here so that building the ``shapegate`` parser does not load uvicorn and FastAPI.
    from engine_pool.sim.faults import FaultError, FaultSpec, parse_fault_arg

    if args.time_scale <= 0:
        print("shapegate sim: --time-scale must be positive", file=sys.stderr)
        return 2
    try:
        profile = load_profile(args.profile)
        faults = parse_fault_arg(args.faults) if args.faults else FaultSpec()
    except (ProfileError, FaultError) as exc:
        print(f"shapegate sim: {exc}", file=sys.stderr)
        return 2
    if args.model:
        profile = profile.model_copy(update={"model": args.model})
    if args.enable_force_include_usage:
        profile = profile.model_copy(update={"enable_force_include_usage": True})
    configure_logging(args.log_level)
    return asyncio.run(_serve(profile, args, faults, counter_for(profile)))
