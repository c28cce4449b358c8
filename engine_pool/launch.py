"""Engine launch commands rendered from a cluster's engine profile, and the checks between them.

A lane's policy in the gateway (slots per endpoint, token range) and its engines' own limits
(sequences, context length) must agree; this module renders the engine's command line from the
same config file the gateway reads, so the two are written down once.

Contract:
- ``render_command(settings, cluster)`` returns the ``EngineCommand`` for that cluster's profile:
  ``vllm serve MODEL ...`` or ``python3 -m sglang.launch_server ...`` plus the environment it
  needs. It raises ``LaunchError`` when the cluster has no ``engine`` profile or its served
  model names cannot be derived. Every flag it emits is in ``KNOWN_FLAGS`` for the pinned
  engine version.
- ``profile_problems(kind, profile)`` lists why that engine release would refuse the profile
  (unknown version, refused or unknown options); settings validation raises on any.
- ``policy_warnings(settings)`` lists where the gateway's policy exceeds an engine's limits;
  ``shapegate check-config`` prints them on stderr. Pure functions of the settings.

Example::

    cmd = render_command(load_settings("configs/production-two-lanes.yaml"), "heavy")
    cmd.shell()  # 'VLLM_API_KEY="${ENGINE_API_KEY}" vllm serve Qwen/Qwen3.6-35B-A3B ...'
    cmd.args("k8s")  # ["vllm", "serve", ...]: a container's command + args

The flag tables and where they were read are in ``engine_pool/engine_flags.py``.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from engine_pool.cluster import EngineKind
from engine_pool.engine_flags import KNOWN_FLAGS, OWNED_FLAGS, SPEC_METHODS
from engine_pool.engine_profile import EngineProfileSettings

# What this module reads of the gateway's settings tree (gateway/settings.py's ``Settings``
# satisfies these; mypy checks it at every call): engine_pool never imports gateway.


class ModelSpec(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def aliases(self) -> tuple[str, ...]: ...


class ClusterSpec(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> EngineKind: ...
    @property
    def models(self) -> tuple[str, ...]: ...
    @property
    def api_key_env(self) -> str | None: ...
    @property
    def engine(self) -> EngineProfileSettings | None: ...


class SlotSpec(Protocol):
    @property
    def per_endpoint(self) -> int: ...


class LendSpec(Protocol):
    @property
    def per_endpoint(self) -> int: ...


class LaneSpec(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def max_prompt_tokens(self) -> int: ...
    @property
    def clusters(self) -> tuple[str, ...]: ...
    @property
    def emergency_clusters(self) -> tuple[str, ...]: ...
    @property
    def slots(self) -> SlotSpec: ...
    @property
    def lend(self) -> LendSpec | None: ...


class Settings(Protocol):
    @property
    def models(self) -> Sequence[ModelSpec]: ...
    @property
    def clusters(self) -> Sequence[ClusterSpec]: ...
    @property
    def lanes(self) -> Sequence[LaneSpec]: ...
    def cluster(self, name: str) -> ClusterSpec: ...


Style = Literal["shell", "k8s", "compose"]

FORCE_USAGE_FLAG = "--enable-force-include-usage"
# What vLLM reads when ``--api-key`` is absent; keeps the key out of the process list.
_VLLM_API_KEY_ENV = "VLLM_API_KEY"


class LaunchError(Exception):
    """No command can be rendered for this cluster; the message says why."""


@dataclass(frozen=True, slots=True)
class EnvRef:
    """A value read from an environment variable when the engine starts (a secret)."""

    name: str

    def render(self, style: Style) -> str:
        # Kubernetes expands $(NAME) in args and env values; compose interpolates ${NAME}.
        if style == "k8s":
            return f"$({self.name})"
        return "${" + self.name + "}"


Arg = str | EnvRef


@dataclass(frozen=True, slots=True)
class EngineCommand:
    """One engine's launch command: argv, plus environment variables it reads."""

    cluster: str
    kind: EngineKind
    version: str
    argv: tuple[Arg, ...]
    env: tuple[tuple[str, Arg], ...] = ()

    def flags(self) -> tuple[str, ...]:
        """Every ``--flag`` in the command line, in order."""
        return tuple(a for a in self.argv if isinstance(a, str) and _is_flag(a))

    def args(self, style: Style) -> list[str]:
        return [_render(a, style) for a in self.argv]

    def environment(self, style: Style) -> dict[str, str]:
        return {name: _render(value, style) for name, value in self.env}

    def shell(self) -> str:
        """A command line for a POSIX shell; secrets stay as ``"${NAME}"`` references."""
        words = [_shell_word(a) for a in self.argv]
        prefix = [f"{name}={_shell_word(value)}" for name, value in self.env]
        return " ".join([*prefix, *words])


def _is_flag(arg: Arg) -> bool:
    return isinstance(arg, str) and arg.startswith("--")


def _render(arg: Arg, style: Style) -> str:
    return arg if isinstance(arg, str) else arg.render(style)


def _shell_word(arg: Arg) -> str:
    return shlex.quote(arg) if isinstance(arg, str) else f'"{arg.render("shell")}"'


def _number(value: float) -> str:
    return f"{value:g}"


def served_names(settings: Settings, cluster: ClusterSpec) -> tuple[str, ...]:
    """The model names the engine must answer to.

    The gateway forwards the client's request body unchanged, so the engine sees whatever name
    or alias the client used: by default every name and alias of the cluster's one model.
    """
    profile = cluster.engine
    if profile is not None and profile.served_model_names:
        return profile.served_model_names
    wanted = cluster.models or tuple(m.name for m in settings.models)
    models = [m for m in settings.models if m.name in wanted or set(m.aliases) & set(wanted)]
    if len(models) != 1:
        raise LaunchError(
            f"cluster {cluster.name!r} serves {len(models)} models; an engine serves one: "
            "set clusters[].models to one model or engine.served_model_names"
        )
    return (models[0].name, *models[0].aliases)


def render_command(settings: Settings, cluster_name: str) -> EngineCommand:
    """The launch command for ``cluster_name``'s engine profile (raises ``LaunchError``)."""
    try:
        cluster = settings.cluster(cluster_name)
    except KeyError:
        known = ", ".join(c.name for c in settings.clusters)
        raise LaunchError(f"no cluster {cluster_name!r} (clusters: {known})") from None
    profile = cluster.engine
    if profile is None:
        raise LaunchError(f"cluster {cluster_name!r} has no engine profile (clusters[].engine)")
    names = served_names(settings, cluster)
    if cluster.kind == "vllm":
        argv, env = _vllm(profile, names, cluster.api_key_env)
    else:
        argv, env = _sglang(profile, names, cluster.api_key_env)
    argv += _extra(profile)
    return EngineCommand(cluster.name, cluster.kind, profile.version, tuple(argv), tuple(env))


def _vllm(
    p: EngineProfileSettings, names: tuple[str, ...], api_key_env: str | None
) -> tuple[list[Arg], list[tuple[str, Arg]]]:
    argv: list[Arg] = ["vllm", "serve", p.model, "--served-model-name", *names]
    argv += ["--host", p.host, "--port", str(p.port)]
    argv += ["--max-model-len", str(p.max_model_len), "--max-num-seqs", str(p.max_num_seqs)]
    if p.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(p.max_num_batched_tokens)]
    argv += ["--gpu-memory-utilization", _number(p.gpu_memory_utilization)]
    argv += ["--tensor-parallel-size", str(p.tensor_parallel_size)]
    if p.prefix_caching is not None:
        argv.append("--enable-prefix-caching" if p.prefix_caching else "--no-enable-prefix-caching")
    if p.kv_cache_dtype != "auto":
        argv += ["--kv-cache-dtype", p.kv_cache_dtype]
    if p.trust_remote_code:
        argv.append("--trust-remote-code")
    spec = p.speculative
    if spec.enabled:
        config: dict[str, object] = {
            "method": SPEC_METHODS["vllm"][spec.method],
            "num_speculative_tokens": spec.num_speculative_tokens,
        }
        if spec.draft_model is not None:
            config["model"] = spec.draft_model
        if spec.prompt_lookup_max is not None:
            config["prompt_lookup_max"] = spec.prompt_lookup_max
        if spec.prompt_lookup_min is not None:
            config["prompt_lookup_min"] = spec.prompt_lookup_min
        argv += ["--speculative-config", json.dumps(config, separators=(",", ":"))]
    # Output tokens for every request, streams whose client asked no usage included; gated on
    # the pinned release having the flag (the gateway estimates from SSE events otherwise).
    if FORCE_USAGE_FLAG in KNOWN_FLAGS.get(("vllm", p.version), ()):
        argv.append(FORCE_USAGE_FLAG)
    # max_num_partial_prefills is never emitted: profile_problems refuses anything but 1.
    env: list[tuple[str, Arg]] = []
    if api_key_env:
        env.append((_VLLM_API_KEY_ENV, EnvRef(api_key_env)))
    return argv, env


def _sglang(
    p: EngineProfileSettings, names: tuple[str, ...], api_key_env: str | None
) -> tuple[list[Arg], list[tuple[str, Arg]]]:
    # SGLang takes one served name; policy_warnings reports the aliases it will not answer to.
    argv: list[Arg] = ["python3", "-m", "sglang.launch_server", "--model-path", p.model]
    argv += ["--served-model-name", names[0], "--host", p.host, "--port", str(p.port)]
    argv += ["--context-length", str(p.max_model_len)]
    argv += ["--max-running-requests", str(p.max_num_seqs)]
    if p.max_num_batched_tokens is not None:
        # The closest SGLang knob to vLLM's per-step token budget: the prefill chunk size.
        argv += ["--chunked-prefill-size", str(p.max_num_batched_tokens)]
    argv += ["--mem-fraction-static", _number(p.gpu_memory_utilization)]
    argv += ["--tp-size", str(p.tensor_parallel_size)]
    if p.prefix_caching is False:
        argv.append("--disable-radix-cache")
    if p.kv_cache_dtype != "auto":
        argv += ["--kv-cache-dtype", p.kv_cache_dtype]
    if p.trust_remote_code:
        argv.append("--trust-remote-code")
    # Without it SGLang serves no /metrics, and the gateway's load scraper sees nothing.
    argv.append("--enable-metrics")
    spec = p.speculative
    if spec.enabled:
        argv += ["--speculative-algorithm", SPEC_METHODS["sglang"][spec.method]]
        if spec.draft_model is not None:
            argv += ["--speculative-draft-model-path", spec.draft_model]
        # A chain of k drafted tokens: k steps, top-1 each, k + 1 tokens verified.
        steps = spec.num_speculative_tokens
        argv += ["--speculative-num-steps", str(steps), "--speculative-eagle-topk", "1"]
        argv += ["--speculative-num-draft-tokens", str(steps + 1)]
    if api_key_env:
        # SGLang 0.5.23 reads its key only from --api-key; the value stays a reference.
        argv += ["--api-key", EnvRef(api_key_env)]
    return argv, []


def _extra(p: EngineProfileSettings) -> list[Arg]:
    out: list[Arg] = []
    for name, value in p.extra_args.items():
        out.append(f"--{name}")
        if value is not True:
            out.append(_number(value) if isinstance(value, float) else str(value))
    return out


def profile_problems(kind: EngineKind, profile: EngineProfileSettings) -> list[str]:
    """Why the pinned engine release would refuse this profile; empty when it would start."""
    known = KNOWN_FLAGS.get((kind, profile.version))
    if known is None:
        pinned = ", ".join(v for k, v in KNOWN_FLAGS if k == kind)
        return [
            f"no flag table for {kind} {profile.version} (known: {pinned}); add one to "
            "engine_pool/engine_flags.py KNOWN_FLAGS after checking that release's own sources"
        ]
    problems: list[str] = []
    if profile.max_num_partial_prefills != 1:
        if kind == "vllm":
            problems.append(
                "max_num_partial_prefills must be 1 on vLLM: the V1 engine refuses more "
                "(NotImplementedError: Concurrent Partial Prefill is not supported) and "
                f"{profile.version} has no such flag"
            )
        else:
            problems.append("max_num_partial_prefills must be 1: SGLang has no such option")
    spec = profile.speculative
    if spec.enabled and spec.method not in SPEC_METHODS[kind]:
        methods = ", ".join(SPEC_METHODS[kind])
        problems.append(f"speculative method {spec.method!r} is not rendered for {kind}: {methods}")
    if (
        kind == "vllm"
        and profile.max_num_batched_tokens is not None
        and profile.max_num_batched_tokens < profile.max_num_seqs
    ):
        problems.append(
            f"max_num_batched_tokens ({profile.max_num_batched_tokens}) is below max_num_seqs "
            f"({profile.max_num_seqs}): vLLM refuses to start"
        )
    for name, value in profile.extra_args.items():
        flag = f"--{name}"
        if flag in OWNED_FLAGS[kind]:
            problems.append(f"extra_args {name!r} is set from the profile's own fields")
        elif flag not in known:
            problems.append(f"extra_args {name!r} is not a known {kind} {profile.version} flag")
        elif value is False:
            problems.append(f"extra_args {name!r}: false is not a value; leave the flag out")
    return problems


def policy_warnings(settings: Settings) -> list[str]:
    """Where the gateway's policy asks more of an engine than its profile allows."""
    warnings: list[str] = []
    for lane in settings.lanes:
        for name in (*lane.clusters, *lane.emergency_clusters):
            cluster = settings.cluster(name)
            profile = cluster.engine
            if profile is None:
                continue
            if lane.slots.per_endpoint > profile.max_num_seqs:
                warnings.append(
                    f"lane {lane.name!r} allows {lane.slots.per_endpoint} requests per endpoint "
                    f"of cluster {name!r}, but its engine runs at most {profile.max_num_seqs} "
                    "sequences: the rest wait inside the engine, out of the gateway's sight"
                )
            lend = lane.lend
            seats = lane.slots.per_endpoint + (lend.per_endpoint if lend is not None else 0)
            if lend is not None and name in lane.clusters and seats > profile.max_num_seqs:
                warnings.append(
                    f"lane {lane.name!r} lends {lend.per_endpoint} seats per endpoint of "
                    f"cluster {name!r} beside its own {lane.slots.per_endpoint}, but its engine "
                    f"runs at most {profile.max_num_seqs} sequences: while a request of the lane "
                    "waits for the borrowers to drain, the excess waits inside the engine"
                )
            if lane.max_prompt_tokens > profile.max_model_len:
                warnings.append(
                    f"lane {lane.name!r} admits prompts up to {lane.max_prompt_tokens - 1} "
                    f"tokens, but cluster {name!r} has max_model_len {profile.max_model_len}: "
                    "the engine refuses the longest of them with 400"
                )
    warnings.extend(_name_warnings(settings))
    return warnings


def _name_warnings(settings: Settings) -> Iterable[str]:
    for cluster in settings.clusters:
        if cluster.engine is None:
            continue
        try:
            names = served_names(settings, cluster)
        except LaunchError as exc:
            yield str(exc)
            continue
        if cluster.kind == "sglang" and len(names) > 1:
            yield (
                f"cluster {cluster.name!r} runs SGLang, which serves one model name: requests "
                f"naming {', '.join(names[1:])} get 404 from the engine"
            )
