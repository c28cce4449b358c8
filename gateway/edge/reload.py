"""Hot reload of the policy: validate in full, then swap whole, or change nothing.

Contract of ``apply_reload(gateway, new_settings)``:
- ``new_settings`` is already a validated ``Settings`` (an invalid file never gets here: the
  caller's ``config_check.load_policy`` raised ``ConfigError`` and nothing changed).
- Keys that only take effect at start (``RESTART_ONLY``: listen address, state backend, logging,
  counting, the Responses affinity map's size and TTL, the prefix index) keep their running
  values and are reported in ``restart_required``.
- New requests see the new policy at once; requests already admitted finish under the policy
  that admitted them (they captured it) and keep their slots. A lowered slot limit admits
  nothing new until usage is under it, because every acquire checks the limit it is given now.
- Tokenizers are reloaded (off the event loop) only when the models changed; the replaced
  counter (its worker thread and tokenizer child process) is closed once the last request
  admitted under the old policy finished (``gateway/lifetime.py``).
- ``tracing`` applies to new requests: a changed section starts a new exporter; the old one is
  flushed and shut down after the last span it holds ended (an extra that is not installed is
  a ``ConfigError``, and nothing changes).
- Clusters added start their probers, removed ones stop them (the monitor restarts over the
  reconciled pool); a removed cluster's in-flight requests finish.
- One ``policy.reloaded`` event with the diff of what changed, and the new version number.

``reload_policy(gateway)`` re-reads the gateway's config file (``POST /admin/reload``);
``reload_on_signal`` and ``watch_config`` run in the app's lifespan and reload on SIGHUP and on
a change of the file's mtime; a failed reload there logs ``policy.reload_failed`` and keeps the
running policy.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any

import anyio

from gateway.config_check import CheckedPolicy, load_policy
from gateway.count.tokens import TokenCounter
from gateway.edge.services import Gateway, clusters_of
from gateway.extras import MissingExtra
from gateway.lifetime import in_thread
from gateway.observe.log import swallowed
from gateway.observe.tracing import Tracing
from gateway.request.auth import ClientAuth
from gateway.request.policy import Policy
from gateway.settings import ConfigError, Settings, with_discovered
from gateway.upstream.engines import slow_start

RESTART_ONLY = (
    "server.host",
    "server.port",
    "server.workers",
    "state",
    "logging",
    "counting",
    # The response id -> endpoint map is built once; a reload must not forget the live entries.
    "routes.response_affinity_entries",
    "routes.response_affinity_ttl_s",
    # The prefix index is built once, too: a reload must not forget where prefixes went.
    "prefix_index",
)


@dataclass(frozen=True, slots=True)
class ReloadResult:
    version: int
    changed: dict[str, dict[str, Any]]
    restart_required: tuple[str, ...]


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted paths to leaves; lists of named things are keyed by name, so a reordering of
    lanes or clusters reads as what it is rather than as every field changing."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if (
        isinstance(value, list | tuple)
        and value
        and all(isinstance(v, dict) and "name" in v for v in value)
    ):
        out = {}
        for item in value:
            out.update(_flatten(item, f"{prefix}[{item['name']}]"))
        return out
    return {prefix: value}


def diff_settings(old: Settings, new: Settings) -> dict[str, dict[str, Any]]:
    before = _flatten(old.model_dump(mode="json"))
    after = _flatten(new.model_dump(mode="json"))
    return {
        key: {"old": before.get(key), "new": after.get(key)}
        for key in sorted(before.keys() | after.keys())
        if before.get(key) != after.get(key)
    }


def _restart_only(key: str) -> bool:
    # The KV event readers are started once, at boot, with the prefix index they feed.
    if key.startswith("clusters[") and ".kv_events" in key:
        return True
    return any(key == p or key.startswith(p + ".") for p in RESTART_ONLY)


def effective_settings(gateway: Gateway, new: Settings) -> Settings:
    """``new`` as a reload applies it: endpoints found by DNS kept, restart-only keys at their
    running values (a shadow policy, gateway/edge/shadow_routes.py, decides with these too)."""
    new = with_discovered(new, gateway.discovered)
    old = gateway.pipeline.policy.settings
    return new.model_copy(
        update={
            "server": new.server.model_copy(
                update={
                    "host": old.server.host,
                    "port": old.server.port,
                    "workers": old.server.workers,
                }
            ),
            "state": old.state,
            "logging": old.logging,
            "counting": old.counting,
        }
    )


async def apply_reload(gateway: Gateway, new: Settings) -> ReloadResult:
    # Endpoints found by DNS stay, whatever the file lists (gateway/edge/discovery.py).
    new = with_discovered(new, gateway.discovered)
    old_policy = gateway.pipeline.policy
    old = old_policy.settings
    changed = diff_settings(old, new)
    restart = tuple(k for k in changed if _restart_only(k))
    effective = effective_settings(gateway, new)
    keys = gateway.engine_keys_for(effective)
    auth = ClientAuth.from_settings(effective.auth)
    counter = old_policy.counter
    if effective.models != old.models:
        counter = await anyio.to_thread.run_sync(
            TokenCounter.from_settings, effective, gateway.metrics
        )
    recorder = gateway.recorder
    tracing = recorder.tracing
    if effective.tracing != old.tracing:
        try:
            tracing = Tracing.from_settings(effective.tracing, gateway.metrics, gateway.log)
        except MissingExtra as exc:
            if counter is not old_policy.counter:
                in_thread(counter.close, "counter-close")()
            raise ConfigError(str(exc), ("tracing", "enabled")) from exc
    policy = Policy(effective, counter, keys, auth, version=old_policy.version + 1)
    for engine in gateway.pool.reconcile(clusters_of(effective)):
        if engine.warming_since is not None:
            slow_start(gateway.log, engine.cluster, engine.url, engine.warming_s, "joined")
    # Removed endpoints drain (their requests finish or, past drain_s, migrate).
    gateway.drainer.adopt(old, effective)
    gateway.pipeline.policy = policy
    if counter is not old_policy.counter:
        if gateway.owns_counter:
            old_policy.in_use.retire(in_thread(old_policy.counter.close, "counter-close"))
        gateway.owns_counter = True
    if tracing is not recorder.tracing:
        if recorder.tracing is not None:
            recorder.tracing.in_use.retire(in_thread(recorder.tracing.close, "tracing-close"))
        recorder.tracing = tracing
    gateway.adopt(effective)
    applied = {k: v for k, v in changed.items() if k not in restart}
    gateway.log.info(
        "policy.reloaded", version=policy.version, changed=applied, restart_required=list(restart)
    )
    return ReloadResult(policy.version, applied, restart)


async def reload_policy(gateway: Gateway, policy: CheckedPolicy | None = None) -> ReloadResult:
    """Re-read the config file (or take ``policy``) and apply it; ConfigError if invalid.

    The same checks as ``serve`` and ``check-config`` (gateway/config_check.py); a tokenizer that
    fails to load is pointed at its line too, and nothing changes."""
    if policy is None:
        if gateway.config_path is None:
            raise ConfigError("this gateway was not started from a config file")
        policy = load_policy(gateway.config_path)
    try:
        return await apply_reload(gateway, policy.settings)
    except ConfigError as exc:
        raise policy.located(exc) from exc


async def reload_on_signal(gateway: Gateway) -> None:
    with anyio.open_signal_receiver(signal.SIGHUP) as signals:
        async for _ in signals:
            await _reload_logged(gateway, "sighup")


async def watch_config(gateway: Gateway) -> None:
    assert gateway.config_path is not None
    seen = gateway.config_path.stat().st_mtime_ns
    while True:
        await anyio.sleep(gateway.settings.server.watch_interval_s)
        try:
            mtime = gateway.config_path.stat().st_mtime_ns
        except OSError as exc:
            swallowed(gateway.log, gateway.metrics, "app.watch_config", exc, decision="keep_policy")
            continue
        if mtime != seen:
            seen = mtime
            await _reload_logged(gateway, "file_changed")


async def _reload_logged(gateway: Gateway, trigger: str) -> None:
    try:
        await reload_policy(gateway)
    except ConfigError as exc:
        gateway.log.warning("policy.reload_failed", trigger=trigger, error=str(exc))
