"""``shapegate init``: an annotated starting policy from a few flags, checked before it is kept.

    shapegate init --engine http://127.0.0.1:9101 [--engine URL ...] [--heavy-engine URL ...]
                   [--model NAME] [--tokenizer qwen3.6 | PATH] [--max-model-len N]
                   [--threshold N] [--output-tokens N] [--chat-template MODE]
                   [--out shapegate.yaml] [--force]

With only ``--engine``, one lane takes every prompt up to the model's context less
``--output-tokens`` (default 4096): room left for the answer, so a prompt that would leave the
engine fewer output tokens than that is refused (400) rather than cut short. With
``--heavy-engine`` too, prompts of ``--threshold`` tokens or more go to a heavy lane of their own.
Chat prompts are counted with the model's own chat template (``hf``, what vLLM renders) when the
tokenizer ships one (the shipped Qwen3.6 does), else ChatML.
The file is written only if it passes the same checks as ``shapegate check-config`` (tokenizer
loaded, lanes covering the context, slot limits); exit code 2 otherwise, and an existing file is
never replaced without ``--force``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from gateway.config_check import parse_policy
from gateway.count.tokenizers.sources import BUILTIN_NAMES, builtin_path
from gateway.edge.admin.guard import reload_command
from gateway.settings import ConfigError


def _local_url(args: argparse.Namespace) -> str:
    """The gateway's URL from its own machine (a wildcard listen address answers on loopback)."""
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host  # noqa: S104
    return f"http://{host}:{args.port}"


def _flow(values: list[str]) -> str:
    return "[" + ", ".join(values) + "]"


def _ships_template(name: str) -> bool:
    """Whether a shipped vocabulary has its model's chat template beside it."""
    with builtin_path(name) as path:
        return (path.parent / "chat_template.jinja").exists()


def _tokenizer(args: argparse.Namespace) -> str:
    if args.tokenizer in BUILTIN_NAMES:
        # The model's own template is the one vLLM renders: counts then equal the engine's.
        template = args.chat_template or ("hf" if _ships_template(args.tokenizer) else "chatml")
        return f"{{source: builtin, name: {args.tokenizer}, chat_template: {template}}}"
    # A folder (or file) holding a Hugging Face tokenizer.json, and its chat template beside it.
    template = args.chat_template or "hf"
    return f"{{source: hf_json, path: {Path(args.tokenizer).resolve()}, chat_template: {template}}}"


def _lane(name: str, low: int, high: int, slots: tuple[int, int], heavy: bool) -> str:
    lane, per_endpoint = slots
    if heavy:
        timeouts = (
            "{connect_s: 5, first_byte_s: 60, first_byte_per_1k_tokens_s: 1.0, idle_s: 120, "
            "total_s: 3600}"
        )
        queue = "{depth: 64, max_wait_s: 1800}"
    else:
        timeouts = "{connect_s: 2, first_byte_s: 30, idle_s: 30, total_s: 300}"
        queue = "{depth: 512, max_wait_s: 30}"
    return f"""\
  - name: {name}
    # This lane takes prompts with {low} <= tokens < {high}.
    min_prompt_tokens: {low}
    max_prompt_tokens: {high}
    clusters: [{name}]
    # lane: requests in flight in the whole lane (every replica); per_endpoint: on one engine,
    # best equal to the engine's --max-num-seqs.
    slots: {{lane: {lane}, per_endpoint: {per_endpoint}}}
    # When every slot is taken: wait in a bounded queue (or on_full: reject, for an instant 429).
    queue: {queue}
    on_full: wait
    # first_byte_per_1k_tokens_s lets a long prefill take its time before the first token.
    timeouts: {timeouts}
"""


def render_policy(args: argparse.Namespace) -> str:
    """The annotated YAML ``init`` writes; pure over the parsed flags."""
    top = args.max_model_len - args.output_tokens
    heavy = bool(args.heavy_engine)
    clusters = f"""\
  - name: {"fast" if heavy else "main"}
    kind: {args.kind}
    # Each engine's base URL; the gateway picks the least loaded one with a free slot.
    endpoints: {_flow(args.engine)}
"""
    if heavy:
        clusters += f"""\
  - name: heavy
    kind: {args.kind}
    endpoints: {_flow(args.heavy_engine)}
"""
        lanes = _lane("fast", 0, args.threshold, (64 * len(args.engine), 64), False)
        lanes += _lane("heavy", args.threshold, top, (4 * len(args.heavy_engine), 4), True)
    else:
        lanes = _lane("main", 0, top, (64 * len(args.engine), 64), False)
    return f"""\
# shapegate policy written by `shapegate init`. Check it, then serve it:
#   shapegate check-config {shlex.quote(args.out)}
#   shapegate serve --config {shlex.quote(args.out)}
# Edit and apply without a restart (from the gateway's machine; with server.admin_token set,
# send it as a bearer token instead of the header):
#   {reload_command(_local_url(args))}
# or kill -HUP the gateway.
server:
  host: {args.host}
  port: {args.port}

models:
  # The name clients send as "model"; the engines must serve it under the same name.
  - name: {args.model}
    # Prompt tokens are counted with this tokenizer and chat template, offline, at every request.
    tokenizer: {_tokenizer(args)}
    # The engine's --max-model-len. The lanes below stop {args.output_tokens} tokens short of it:
    # room for the answer; a longer prompt is refused with 400 rather than cut to a short answer.
    max_model_len: {args.max_model_len}

clusters:
{clusters}
lanes:
  # A prompt goes to the lane whose [min_prompt_tokens, max_prompt_tokens) range holds its
  # token count; ranges start at 0 and leave no gap. Longer prompts are refused with 400.
{lanes}
state:
  # memory: one gateway replica. redis: slots shared by every replica (state.redis_url).
  backend: memory
"""


def _init(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and not args.force:
        print(f"shapegate init: {out} exists; pass --force to replace it", file=sys.stderr)
        return 2
    if not 0 <= args.output_tokens < args.max_model_len:
        print(
            "shapegate init: --output-tokens must lie between 0 and --max-model-len",
            file=sys.stderr,
        )
        return 2
    top = args.max_model_len - args.output_tokens
    if args.heavy_engine and not 0 < args.threshold < top:
        print(
            f"shapegate init: --threshold must lie between 0 and {top} (--max-model-len less "
            "--output-tokens)",
            file=sys.stderr,
        )
        return 2
    text = render_policy(args)
    try:
        parse_policy(text, str(out)).load_counter()
    except ConfigError as exc:
        print(f"shapegate init: the policy would not serve: {exc}", file=sys.stderr)
        return 2
    out.write_text(text, encoding="utf-8")
    print(
        f"wrote {out}\n"
        f"  check:  shapegate check-config {shlex.quote(str(out))}\n"
        f"  serve:  shapegate serve --config {shlex.quote(str(out))}\n"
        f"  reload: {reload_command(_local_url(args))}"
    )
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    init = subparsers.add_parser("init", help="write an annotated starting policy")
    init.add_argument(
        "--engine",
        action="append",
        required=True,
        metavar="URL",
        help="an engine's base URL (repeatable); with --heavy-engine, the fast lane's engines",
    )
    init.add_argument(
        "--heavy-engine",
        action="append",
        default=[],
        metavar="URL",
        help="an engine for prompts of --threshold tokens or more (repeatable; none: one lane)",
    )
    init.add_argument("--model", default="qwen3.6", help="the model name clients send")
    init.add_argument(
        "--tokenizer",
        default="qwen3.6",
        help=f"a shipped tokenizer ({', '.join(BUILTIN_NAMES)}) or a folder holding the model's "
        "tokenizer.json (and its chat template)",
    )
    init.add_argument(
        "--chat-template",
        choices=("chatml", "hf", "none"),
        default=None,
        help="how chat messages become the prompt (default: hf, the model's own template, what "
        "vLLM renders; chatml for a shipped tokenizer with no template)",
    )
    init.add_argument(
        "--max-model-len", type=int, default=131072, help="the engines' context, in tokens"
    )
    init.add_argument(
        "--output-tokens",
        type=int,
        default=4096,
        help="room kept for the answer: lanes end this many tokens short of --max-model-len",
    )
    init.add_argument(
        "--threshold",
        type=int,
        default=32768,
        help="prompt tokens from which the heavy lane takes a request",
    )
    init.add_argument("--kind", choices=("vllm", "sglang"), default="vllm", help="engine kind")
    init.add_argument("--host", default="127.0.0.1", help="the gateway's listen address")
    init.add_argument("--port", type=int, default=8000, help="the gateway's port")
    init.add_argument("--out", default="shapegate.yaml", help="policy file to write")
    init.add_argument("--force", action="store_true", help="replace an existing --out file")
    init.set_defaults(func=_init)
