"""The ``shapegate`` command: serve, check-config, and the subcommands other modules register.

Each subcommand module exposes ``register(subparsers)``, which adds its parser and sets
``func`` to a callable returning the exit code. ``REGISTRARS`` lists them by import path so
that ``shapegate serve`` does not import the simulator or the benchmarks.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from engine_pool.launch import policy_warnings
from gateway.config_check import load_policy
from gateway.extras import MissingExtra
from gateway.request import borrowing, classes
from gateway.settings import ConfigError, Settings
from gateway.shipped import policy_names, resolve_policy

MAX_WORKERS = 64  # server.workers' bound (gateway/settings.py)
REGISTRARS: tuple[str, ...] = (
    # one module path a line
    "gateway.tools.sim_support",
    "gateway.tools.demo",
    "gateway.tools.init_cli",
    "gateway.tuning.replay_cli",
    "gateway.tools.bench",
    "gateway.tools.launch_cli",
)


def _worker_count(text: str) -> int:
    count = int(text) if text.strip().isdigit() else 0
    if not 1 <= count <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to {MAX_WORKERS}")
    return count


def _serve(args: argparse.Namespace) -> int:
    from gateway.edge.server import serve, serve_worker
    from gateway.edge.workers import supervise
    from gateway.slots.host import WorkerGroup

    path = resolve_policy(args.config)
    try:
        policy = load_policy(path)
    except ConfigError as exc:
        print(f"shapegate: {exc}", file=sys.stderr)
        return 2
    settings = policy.settings
    overrides = {}
    if args.host is not None:
        overrides["host"] = args.host
    if args.port is not None:
        overrides["port"] = args.port
    if args.workers is not None:
        overrides["workers"] = args.workers
    if overrides:
        settings = settings.model_copy(
            update={"server": settings.server.model_copy(update=overrides)}
        )
    try:
        if args.worker_index is not None:  # started by the supervisor (gateway/edge/workers.py)
            group = WorkerGroup(args.worker_index, settings.server.workers, Path(args.worker_dir))
            return serve_worker(settings, path, group)
        if settings.server.workers > 1:
            return supervise(settings, path, settings.server.workers)
        return serve(settings, path)
    except ConfigError as exc:  # a tokenizer or template that fails to load at boot
        print(f"shapegate: {policy.located(exc)}", file=sys.stderr)
        return 2


def describe_policy(settings: Settings) -> str:
    """The effective policy in a form an operator can read at a glance."""
    lines = ["models:"]
    for model in settings.models:
        tok = model.tokenizer
        lines.append(
            f"  {model.name} (aliases: {', '.join(model.aliases) or '-'}) tokenizer "
            f"{tok.source}:{tok.name or tok.path} template={tok.chat_template} "
            f"max_model_len={model.max_model_len or '-'}"
        )
    lines.append("clusters:")
    for cluster in settings.clusters:
        found = cluster.discovery
        dns = f" + DNS {found.name}:{found.port} every {found.interval_s:g}s" if found else ""
        lines.append(f"  {cluster.name} [{cluster.kind}] {', '.join(cluster.endpoints)}{dns}")
    lines.append("lanes (tried in order):")
    for lane in settings.lanes:
        t = lane.timeouts
        lines.append(
            f"  {lane.name}: {lane.min_prompt_tokens} <= prompt tokens < {lane.max_prompt_tokens}"
        )
        lines.append(
            f"    clusters {', '.join(lane.clusters)}; emergency "
            f"{', '.join(lane.emergency_clusters) or '-'}"
        )
        lines.append(
            f"    slots: lane {lane.slots.lane}, per endpoint {lane.slots.per_endpoint}; "
            f"queue depth {lane.queue.depth}, max wait {lane.queue.max_wait_s:g}s; "
            f"on_full={lane.on_full}"
        )
        lines.append(
            f"    timeouts: connect {t.connect_s:g}s, first byte {t.first_byte_s:g}s "
            f"+ {t.first_byte_per_1k_tokens_s:g}s/1k tokens, idle {t.idle_s:g}s, "
            f"total {t.total_s:g}s"
        )
        lines.extend(borrowing.explain(lane))
    lines.extend(classes.explain(settings.classes))
    state = settings.state
    where = f" at {state.redis_url}" if state.backend == "redis" else ""
    lines.append(f"state: {state.backend}{where}, on redis down: {state.on_redis_down}")
    workers = settings.server.workers
    if workers > 1:
        kept = "Redis" if state.backend == "redis" else "the supervisor's slot server"
        lines.append(f"workers: {workers}, slots kept by {kept}")
    return "\n".join(lines)


def _check_config(args: argparse.Namespace) -> int:
    try:
        policy = load_policy(resolve_policy(args.config))
        counter = policy.load_counter()
    except ConfigError as exc:
        print(f"shapegate: {exc}", file=sys.stderr)
        return 2
    try:
        warnings = [*counter.template_warnings(policy.settings), *policy_warnings(policy.settings)]
    finally:
        counter.close()
    print(describe_policy(policy.settings))
    sys.stderr.writelines(f"shapegate: warning: {w}\n" for w in warnings)
    return 0


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" where there is a default to tell (not None, not a flag's False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.required or action.default in (None, False, [], ()):
            return text
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """Every (sub)command's ``--help`` shows each option's default; subcommands inherit it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)


POLICY_HELP = "policy file (YAML), or a shipped policy by name: " + ", ".join(
    f"configs/{name}.yaml" for name in policy_names()
)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="shapegate", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--version", action="version", version=f"shapegate {metadata.version('shapegate')}"
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", help="COMMAND --help tells more"
    )

    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", required=True, help=POLICY_HELP)
    serve.add_argument("--host", default=None, help="listen address (default: server.host)")
    serve.add_argument("--port", type=int, default=None, help="listen port (default: server.port)")
    serve.add_argument(
        "--workers",
        type=_worker_count,
        default=None,
        help="worker processes on the one port (default: server.workers); above 1, a "
        "supervisor keeps the slots of all of them unless state.backend is redis",
    )
    # How the supervisor starts a worker (gateway/edge/workers.py); not for people.
    serve.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    serve.add_argument("--worker-dir", default=None, help=argparse.SUPPRESS)
    serve.set_defaults(func=_serve)

    check = sub.add_parser(
        "check-config",
        help="validate a policy as serve does at boot (tokenizers, templates, environment) "
        "and print it",
    )
    check.add_argument("config", help=POLICY_HELP)
    check.set_defaults(func=_check_config)

    for path in REGISTRARS:
        importlib.import_module(path).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except (ConfigError, MissingExtra) as exc:  # what the user must fix: said once, exit 2
        print(f"shapegate: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
