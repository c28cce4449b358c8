"""The one settings tree: a YAML file plus ``SHAPEGATE_*`` environment overrides.

Contract:
- ``load_settings(path)`` returns a frozen, fully validated ``Settings`` or raises
  ``ConfigError`` with a message that names the offending key.
- Unknown keys are errors everywhere (``extra="forbid"``): a typo never becomes a silent default.
- Environment variables override the file, nested keys joined by ``__``:
  ``SHAPEGATE_STATE__BACKEND=redis``, ``SHAPEGATE_SERVER__PORT=9000``. Values are parsed as
  YAML scalars, so ``SHAPEGATE_LANES='[...]'`` is rejected only if the YAML is invalid.
- Cross-references are checked: every lane names clusters that exist, lane token ranges do not
  overlap, every model has a tokenizer.

Example::

    settings = load_settings("configs/demo.yaml")
    settings.lane("fast").max_prompt_tokens  # 32768
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from engine_pool.launch import profile_problems

ENV_PREFIX = "SHAPEGATE_"


class ConfigError(Exception):
    """The configuration file or environment is invalid; the message says where and why."""


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerSettings(_Frozen):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    # How long a client may take to send its whole request body.
    body_timeout_s: float = Field(30.0, gt=0)
    # On SIGTERM: stop admitting, let in-flight requests finish up to this long.
    drain_timeout_s: float = Field(30.0, ge=0)
    decision_ring_size: int = Field(200, ge=1, le=100_000)
    # At start-up, one tiny real request through each lane; /readyz is 503 until all passed.
    boot_probe: bool = True
    # A client must send its whole request line and headers within this (slowloris).
    header_timeout_s: float = Field(10.0, gt=0)
    max_header_bytes: int = Field(64 * 1024, ge=1024)
    # Reload the policy when the config file changes (SIGHUP and POST /admin/reload always do).
    watch_config: bool = False
    watch_interval_s: float = Field(2.0, gt=0)
    # Bearer token for /admin/* (also SHAPEGATE_SERVER__ADMIN_TOKEN). Unset: admin endpoints
    # and the dashboard answer loopback clients only.
    admin_token: SecretStr | None = Field(None, min_length=16)


class LoggingSettings(_Frozen):
    level: Literal["debug", "info", "warning", "error"] = "info"
    json_output: bool = True


class TokenizerSettings(_Frozen):
    """Where a model's tokenizer comes from. Loaded and warmed at start-up, never from the network.

    - ``builtin``: a vocabulary shipped with shapegate (``name``: ``qwen3.6``).
    - ``hf_json``: a Hugging Face ``tokenizer.json`` file, or a folder holding one (``path``).
    - ``tiktoken_file``: a ``.tiktoken`` rank file (``path``) with a ``pretokenizer`` name.
    - ``tiktoken_encoding``: a named tiktoken encoding (``name``: ``cl100k_base``), offline.
    """

    source: Literal["builtin", "hf_json", "tiktoken_file", "tiktoken_encoding"] = "builtin"
    name: str | None = None
    path: str | None = None
    pretokenizer: str | None = None
    # tiktoken_file only: the special tokens the rank file cannot carry, content -> id
    # ({"<|im_start|>": 248045, ...}); matched in text as one token each.
    special_tokens: dict[str, int] = Field(default_factory=dict)
    # How chat messages become the prompt the engine sees.
    chat_template: Literal["chatml", "hf", "none"] = "chatml"
    # Which encoder runs the exact count; ``auto`` prefers gigatoken and logs the fallback.
    backend: Literal["auto", "gigatoken", "tiktoken", "hf"] = "auto"

    @model_validator(mode="after")
    def _needs_name_or_path(self) -> TokenizerSettings:
        if self.source in ("builtin", "tiktoken_encoding") and not self.name:
            raise ValueError(f"tokenizer source {self.source!r} needs 'name'")
        if self.source in ("hf_json", "tiktoken_file") and not self.path:
            raise ValueError(f"tokenizer source {self.source!r} needs 'path'")
        return self


class AuthSettings(_Frozen):
    """Client API keys; none configured means the API is open (admin has its own guard)."""

    # Hex SHA-256 digests of accepted keys: `printf %s "$KEY" | sha256sum`.
    api_key_sha256: tuple[str, ...] = ()
    # An environment variable holding plain keys separated by commas (hashed at start-up).
    api_keys_env: str | None = None

    @model_validator(mode="after")
    def _hex(self) -> AuthSettings:
        for digest in self.api_key_sha256:
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest.lower()):
                raise ValueError(
                    f"api_key_sha256 entry {digest[:12]}... is not a SHA-256 hex digest"
                )
        return self


class ModelSettings(_Frozen):
    name: str = Field(min_length=1)
    # Other names clients may use for the same model.
    aliases: tuple[str, ...] = ()
    tokenizer: TokenizerSettings
    max_model_len: int | None = Field(None, ge=1)


class CountingSettings(_Frozen):
    cache_entries: int = Field(8192, ge=0)
    # Where exact counts run off the event loop.
    exact_executor: Literal["thread", "inline"] = "thread"
    exact_workers: int = Field(1, ge=1, le=64)


class SpeculativeSettings(_Frozen):
    """Speculative decoding on one engine: it pays at low concurrency (the heavy lane) and costs
    throughput at high concurrency, where the batch already keeps the GPU busy."""

    enabled: bool = False
    # Engine-neutral: mtp (the model's own multi-token-prediction layers), eagle and eagle3 (a
    # draft head named in draft_model), ngram (prompt lookup; vLLM only).
    method: Literal["mtp", "eagle", "eagle3", "ngram"] = "mtp"
    num_speculative_tokens: int = Field(2, ge=1, le=16)
    draft_model: str | None = Field(None, min_length=1)
    prompt_lookup_min: int | None = Field(None, ge=1)
    prompt_lookup_max: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _method_fields(self) -> SpeculativeSettings:
        if self.method in ("eagle", "eagle3") and self.draft_model is None:
            raise ValueError(f"speculative method {self.method!r} needs 'draft_model'")
        if self.method in ("mtp", "ngram") and self.draft_model is not None:
            raise ValueError(f"speculative method {self.method!r} takes no 'draft_model'")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if self.method != "ngram" and (low, high) != (None, None):
            raise ValueError("prompt_lookup_min/max apply to the 'ngram' method only")
        if low is not None and high is not None and low > high:
            raise ValueError("prompt_lookup_min must not exceed prompt_lookup_max")
        return self


class EngineProfileSettings(_Frozen):
    """How a cluster's engines are launched (``shapegate launch-command``); the engine kind is
    the cluster's ``kind``. Checked against the pinned version's flags (engine_pool/launch.py)."""

    # The exact engine release; its flags must be in engine_pool/engine_flags.py KNOWN_FLAGS.
    version: str = Field(pattern=r"^[0-9]+\.[0-9]+\.[0-9]+(\.post[0-9]+)?$")
    # The weights: a Hugging Face id or a path inside the engine's container.
    model: str = Field(min_length=1)
    # Names the engine answers to; empty means the gateway's name and aliases for the model.
    served_model_names: tuple[str, ...] = ()
    host: str = "0.0.0.0"  # noqa: S104 - an engine in a container listens on its pod address
    port: int = Field(8000, ge=1, le=65535)
    max_model_len: int = Field(ge=1)
    max_num_seqs: int = Field(ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    # vLLM V1 refuses anything but 1; kept so a config asking for more fails here, not on a GPU.
    max_num_partial_prefills: int = Field(1, ge=1)
    # Above ~0.9 nothing is left for activation spikes and the CUDA graphs: OOM under load.
    gpu_memory_utilization: float = Field(0.85, ge=0.1, le=0.95)
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    # None leaves the engine's default.
    prefix_caching: bool | None = None
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "fp8_e5m2"] = "auto"
    trust_remote_code: bool = False
    speculative: SpeculativeSettings = SpeculativeSettings()
    # More engine flags: name without "--" -> value (true for a bare flag); known flags only.
    extra_args: dict[str, str | int | float | bool] = Field(default_factory=dict)


class ClusterSettings(_Frozen):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    kind: Literal["vllm", "sglang"] = "vllm"
    endpoints: tuple[str, ...] = Field(min_length=1)
    # Models this cluster serves; empty means every configured model.
    models: tuple[str, ...] = ()
    # Name of an environment variable holding the engine's API key, sent as a bearer token.
    api_key_env: str | None = None
    # Forward the client's own Authorization header to this cluster.
    forward_client_auth: bool = False
    # The liveness endpoint probed; SGLang also offers /health_generate (a one-token generation).
    health_path: str = Field("/health", pattern=r"^/")
    # The simulated engine profile (configs/engines/NAME.yaml) standing in for this cluster's
    # engines in `shapegate demo` and `shapegate replay --simulate`.
    sim_profile: str | None = None
    # How the engines are launched; optional: the gateway itself never reads it.
    engine: EngineProfileSettings | None = None

    @model_validator(mode="after")
    def _endpoints_are_urls(self) -> ClusterSettings:
        for url in self.endpoints:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"cluster {self.name!r}: endpoint {url!r} is not an http(s) URL")
        if len(set(self.endpoints)) != len(self.endpoints):
            raise ValueError(f"cluster {self.name!r}: duplicate endpoints")
        problems = profile_problems(self.kind, self.engine) if self.engine else []
        if problems:
            raise ValueError(f"cluster {self.name!r} engine: " + "; ".join(problems))
        return self


class SlotSettings(_Frozen):
    # Requests in flight in the whole lane (across every cluster and replica).
    lane: int = Field(ge=1)
    # Requests in flight on one engine endpoint.
    per_endpoint: int = Field(ge=1)


class QueueSettings(_Frozen):
    depth: int = Field(256, ge=0)
    max_wait_s: float = Field(30.0, ge=0)


class TimeoutSettings(_Frozen):
    connect_s: float = Field(5.0, gt=0)
    # First byte deadline = first_byte_s + first_byte_per_1k_tokens_s * prompt_tokens / 1000.
    first_byte_s: float = Field(30.0, gt=0)
    first_byte_per_1k_tokens_s: float = Field(0.0, ge=0)
    # Longest silence between two chunks of a streaming response.
    idle_s: float = Field(60.0, gt=0)
    total_s: float = Field(900.0, gt=0)


class HealthSettings(_Frozen):
    """How a lane's engines are probed; a heavy lane's engines are slow by design."""

    interval_s: float = Field(5.0, gt=0)
    # A probe slower than this is an alert (engine.slow), not a failure.
    timeout_s: float = Field(10.0, gt=0)
    # Consecutive timed-out probes, with no token progress in the engine's metrics, before DOWN.
    down_after_timeouts: int = Field(3, ge=1)
    # Consecutive good probes before a DOWN engine is routable again.
    up_after_successes: int = Field(2, ge=1)
    # How often the engine's /metrics are read for load and progress.
    scrape_interval_s: float = Field(5.0, gt=0)


class LaneSettings(_Frozen):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    # The lane takes prompts with min_prompt_tokens <= tokens < max_prompt_tokens.
    min_prompt_tokens: int = Field(0, ge=0)
    max_prompt_tokens: int = Field(ge=1)
    clusters: tuple[str, ...] = Field(min_length=1)
    # Used only while every primary cluster is down; never because a primary is busy.
    emergency_clusters: tuple[str, ...] = ()
    slots: SlotSettings
    queue: QueueSettings = QueueSettings()
    # When every slot is taken: wait in the lane's queue, or reject at once (429).
    on_full: Literal["wait", "reject"] = "wait"
    timeouts: TimeoutSettings = TimeoutSettings()
    health: HealthSettings = HealthSettings()
    # Send requests sharing a prompt prefix (the system prompt, else the first message's first
    # affinity_prefix_bytes) to the same endpoint, where the engine has it cached.
    prefix_affinity: bool = False
    affinity_prefix_bytes: int = Field(4096, ge=64)

    @model_validator(mode="after")
    def _range(self) -> LaneSettings:
        if self.min_prompt_tokens >= self.max_prompt_tokens:
            raise ValueError(
                f"lane {self.name!r}: min_prompt_tokens must be below max_prompt_tokens"
            )
        return self


class RouteSettings(_Frozen):
    """The engine API routes beyond chat and completions (gateway/routes.py)."""

    # The lane for multipart routes (/v1/audio/*), which carry no text to count; default: the
    # lane that starts at 0 tokens.
    multipart_lane: str | None = None
    # Client headers forwarded to engines on top of the built-in allowlist (content-type,
    # accept, user-agent, traceparent, tracestate, x-request-id), e.g. x-tenant,
    # openai-organization. Authorization and hop-by-hop headers cannot be added here.
    forward_headers: tuple[str, ...] = ()
    # Stateful Responses: response id -> the endpoint that produced it, at most this many.
    response_affinity_entries: int = Field(100_000, ge=0)
    response_affinity_ttl_s: float = Field(24 * 3600.0, gt=0)

    @model_validator(mode="after")
    def _headers(self) -> RouteSettings:
        refused = {"authorization", "proxy-authorization", "cookie", "host", "content-length"}
        refused |= {"connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade"}
        for name in self.forward_headers:
            if not name or any(not (c.isalnum() or c in "-_") for c in name):
                raise ValueError(f"forward_headers: {name!r} is not a header name")
            if name.lower() in refused:
                raise ValueError(f"forward_headers: {name!r} cannot be forwarded")
        return self


class StateSettings(_Frozen):
    backend: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "shapegate"
    lease_ttl_s: float = Field(30.0, gt=0)
    # A lease is never renewed past this age: the backstop for a runaway request.
    lease_max_life_s: float = Field(6 * 3600.0, gt=0)
    on_redis_down: Literal["fail_closed", "fail_open_local"] = "fail_closed"
    # Replicas sharing the limits; fail_open_local divides each limit by this.
    replicas: int = Field(1, ge=1)
    # How often a waiter re-checks for a slot freed by another replica.
    poll_interval_s: float = Field(0.05, gt=0)
    # Append the shape of every routed request (never its text) to this JSON-lines file.
    trace_file: str | None = None
    # Bound on every Redis call; with Redis down, fail_closed answers 503 within about this.
    redis_timeout_s: float = Field(0.5, gt=0, le=10)


class Settings(_Frozen):
    server: ServerSettings = ServerSettings()
    logging: LoggingSettings = LoggingSettings()
    models: tuple[ModelSettings, ...] = Field(min_length=1)
    counting: CountingSettings = CountingSettings()
    clusters: tuple[ClusterSettings, ...] = Field(min_length=1)
    lanes: tuple[LaneSettings, ...] = Field(min_length=1)
    state: StateSettings = StateSettings()
    auth: AuthSettings = AuthSettings()
    routes: RouteSettings = RouteSettings()

    @model_validator(mode="after")
    def _cross_references(self) -> Settings:
        names = [c.name for c in self.clusters]
        if len(set(names)) != len(names):
            raise ValueError("cluster names must be unique")
        lane_names = [lane.name for lane in self.lanes]
        if len(set(lane_names)) != len(lane_names):
            raise ValueError("lane names must be unique")
        model_names = [n for m in self.models for n in (m.name, *m.aliases)]
        if len(set(model_names)) != len(model_names):
            raise ValueError("model names and aliases must be unique")
        known = set(names)
        for lane in self.lanes:
            for cluster in (*lane.clusters, *lane.emergency_clusters):
                if cluster not in known:
                    raise ValueError(f"lane {lane.name!r} names unknown cluster {cluster!r}")
            if set(lane.clusters) & set(lane.emergency_clusters):
                raise ValueError(f"lane {lane.name!r}: a cluster is both primary and emergency")
        for spec in self.clusters:
            for model in spec.models:
                if model not in model_names:
                    raise ValueError(f"cluster {spec.name!r} names unknown model {model!r}")
        ranges = sorted(
            (lane.min_prompt_tokens, lane.max_prompt_tokens, lane.name) for lane in self.lanes
        )
        for (_, hi, a), (lo, _, b) in itertools.pairwise(ranges):
            if lo < hi:
                raise ValueError(f"lanes {a!r} and {b!r} have overlapping token ranges")
        multipart = self.routes.multipart_lane
        if multipart is not None and multipart not in lane_names:
            raise ValueError(f"routes.multipart_lane names unknown lane {multipart!r}")
        return self

    @property
    def multipart_lane(self) -> str:
        """The lane for requests with no text to count: the policy's choice, else the lowest."""
        if self.routes.multipart_lane is not None:
            return self.routes.multipart_lane
        return min(self.lanes, key=lambda lane: lane.min_prompt_tokens).name

    def lane(self, name: str) -> LaneSettings:
        for lane in self.lanes:
            if lane.name == name:
                return lane
        raise KeyError(name)

    def cluster(self, name: str) -> ClusterSettings:
        for cluster in self.clusters:
            if cluster.name == name:
                return cluster
        raise KeyError(name)

    def model(self, name: str) -> ModelSettings | None:
        """The model a client name refers to (by name or alias), or None."""
        for model in self.models:
            if name == model.name or name in model.aliases:
                return model
        return None


def _env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or key == ENV_PREFIX + "CONFIG":
            continue
        path = [part.lower() for part in key[len(ENV_PREFIX) :].split("__")]
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = yaml.safe_load(raw) if raw else raw
    return tree


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def _describe(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        lines.append(f"  {where}: {err['msg']}")
    return "invalid configuration:\n" + "\n".join(lines)


def parse_settings(data: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Settings:
    """Validate a config mapping (as read from YAML) merged with environment overrides."""
    merged = _merge(dict(data), _env_overrides(os.environ if environ is None else environ))
    try:
        return Settings.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from exc


def load_settings(path: str | Path, environ: Mapping[str, str] | None = None) -> Settings:
    """Read, merge and validate a YAML config file; raise ConfigError on any problem."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return parse_settings(data, environ)
