"""Hot reload of the policy: validate in full, then swap whole, or change nothing.

Contract of ``apply_reload(gateway, new_settings)``:
- ``new_settings`` is already a validated ``Settings`` (an invalid file never gets here: the
  caller's ``load_settings`` raised ``ConfigError`` and nothing changed).
- Keys that only take effect at start (``RESTART_ONLY``: listen address, state backend, logging)
  keep their running values and are reported in ``restart_required``.
- New requests see the new policy at once; requests already admitted finish under the policy
  that admitted them (they captured it) and keep their slots. A lowered slot limit admits
  nothing new until usage is under it, because every acquire checks the limit it is given now.
- Tokenizers are reloaded (off the event loop) only when the models changed.
- Clusters added start their probers, removed ones stop them (the monitor restarts over the
  reconciled pool); a removed cluster's in-flight requests finish.
- One ``policy.reloaded`` event with the diff of what changed, and the new version number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from engine_pool.cluster import Cluster
from gateway.auth import ClientAuth
from gateway.pipeline import Policy
from gateway.settings import Settings
from gateway.tokens import TokenCounter

if TYPE_CHECKING:
    from gateway.app import Gateway

RESTART_ONLY = (
    "server.host",
    "server.port",
    "state",
    "logging",
    "counting",
    # The response id -> endpoint map is built once; a reload must not forget the live entries.
    "routes.response_affinity_entries",
    "routes.response_affinity_ttl_s",
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
    return any(key == p or key.startswith(p + ".") for p in RESTART_ONLY)


async def apply_reload(gateway: Gateway, new: Settings) -> ReloadResult:
    old_policy = gateway.pipeline.policy
    old = old_policy.settings
    changed = diff_settings(old, new)
    restart = tuple(k for k in changed if _restart_only(k))
    effective = new.model_copy(
        update={
            "server": new.server.model_copy(
                update={"host": old.server.host, "port": old.server.port}
            ),
            "state": old.state,
            "logging": old.logging,
            "counting": old.counting,
        }
    )
    counter = old_policy.counter
    if effective.models != old.models:
        counter = await anyio.to_thread.run_sync(
            TokenCounter.from_settings, effective, gateway.metrics
        )
    keys = gateway.engine_keys_for(effective)
    auth = ClientAuth.from_settings(effective.auth)
    policy = Policy(effective, counter, keys, auth, version=old_policy.version + 1)
    gateway.pool.reconcile(
        Cluster(name=c.name, kind=c.kind, endpoints=c.endpoints, models=c.models)
        for c in effective.clusters
    )
    gateway.pipeline.policy = policy
    gateway.adopt(effective)
    applied = {k: v for k, v in changed.items() if k not in restart}
    gateway.log.info(
        "policy.reloaded", version=policy.version, changed=applied, restart_required=list(restart)
    )
    return ReloadResult(policy.version, applied, restart)
