"""``shapegate launch-command``: print the engine command for one cluster's engine profile.

    shapegate launch-command --config FILE --cluster NAME [--format shell|k8s|json]

``shell`` (default) prints one command line, secrets as ``"${NAME}"`` references; ``k8s``
prints the ``command``/``args``/``env`` of a Kubernetes container (secrets as ``$(NAME)``, which
Kubernetes expands); ``json`` prints the same as one JSON object. Exit codes: 0 printed, 2 the
config is invalid or the cluster has no renderable profile. Policy warnings go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys

import yaml

from engine_pool.launch import EngineCommand, LaunchError, policy_warnings, render_command
from gateway.config_check import load_settings
from gateway.settings import ConfigError
from gateway.shipped import resolve_policy


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "launch-command", help="print the engine launch command for a cluster's engine profile"
    )
    parser.add_argument(
        "--config", required=True, help="policy file (YAML), or a shipped one: configs/NAME.yaml"
    )
    parser.add_argument("--cluster", required=True, help="cluster name")
    parser.add_argument(
        "--format",
        choices=("shell", "k8s", "json"),
        default="shell",
        help="one command line, a Kubernetes container's fields, or those as JSON",
    )
    parser.set_defaults(func=run)


def container_fields(command: EngineCommand) -> dict[str, object]:
    """The Kubernetes container fields that launch this engine."""
    args = command.args("k8s")
    fields: dict[str, object] = {"command": args[:1], "args": args[1:]}
    env = command.environment("k8s")
    if env:
        fields["env"] = [{"name": name, "value": value} for name, value in env.items()]
    return fields


def run(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(resolve_policy(args.config))
        command = render_command(settings, args.cluster)
    except (ConfigError, LaunchError) as exc:
        print(f"shapegate: {exc}", file=sys.stderr)
        return 2
    sys.stderr.writelines(f"shapegate: warning: {w}\n" for w in policy_warnings(settings))
    if args.format == "shell":
        print(command.shell())
    elif args.format == "k8s":
        print(yaml.safe_dump(container_fields(command), sort_keys=False, width=1000), end="")
    else:
        print(json.dumps(container_fields(command)))
    return 0
